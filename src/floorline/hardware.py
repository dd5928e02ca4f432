"""The GPU catalogue (datasheet figures with their sources) and detection of the running device."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from floorline.errors import FloorlineError


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # catalogue key, e.g. "h200"
    full_name: str
    peak_gbps: float  # peak memory bandwidth, GB/s (1e9 bytes/s)
    memory_gb: float
    sms: int | None
    source: str
    pattern: str = ""  # regex matched against torch's device name, for detection


CATALOGUE = (
    DeviceSpec("h200", "NVIDIA H200 SXM 141GB", 4800, 141, 132,
               "NVIDIA H200 Tensor Core GPU datasheet (4.8 TB/s, 141 GB HBM3e); 132 SMs",
               r"\bH200\b"),
    DeviceSpec("h100-pcie", "NVIDIA H100 PCIe 80GB", 2000, 80, 114,
               "NVIDIA H100 Tensor Core GPU datasheet (PCIe: 2 TB/s, 80 GB HBM2e); 114 SMs",
               r"\bH100\b.*PCIe"),
    DeviceSpec("h100-sxm5", "NVIDIA H100 SXM5 80GB", 3350, 80, 132,
               "NVIDIA H100 Tensor Core GPU datasheet (SXM: 3.35 TB/s, 80 GB HBM3); 132 SMs",
               r"\bH100\b(?!.*(PCIe|NVL))"),
    DeviceSpec("a100-80gb-sxm4", "NVIDIA A100 80GB SXM4", 2039, 80, 108,
               "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 2,039 GB/s HBM2e); 108 SMs",
               r"\bA100\b.*SXM4?-80GB|\bA100 80GB\b(?!.*PCIe)"),
    DeviceSpec("a100-40gb", "NVIDIA A100 40GB", 1555, 40, 108,
               "NVIDIA A100 Tensor Core GPU datasheet (40GB: 1,555 GB/s HBM2); 108 SMs",
               r"\bA100\b.*40GB"),
    DeviceSpec("l40s", "NVIDIA L40S", 864, 48, 142,
               "NVIDIA L40S datasheet (864 GB/s, 48 GB GDDR6); 142 SMs", r"\bL40S\b"),
    DeviceSpec("l4", "NVIDIA L4", 300, 24, 58,
               "NVIDIA L4 Tensor Core GPU datasheet (300 GB/s, 24 GB GDDR6); 58 SMs", r"\bL4\b"),
    DeviceSpec("a10g", "NVIDIA A10G", 600, 24, 80,
               "AWS EC2 G5 documentation / NVIDIA A10G (600 GB/s, 24 GB GDDR6); 80 SMs",
               r"\bA10G\b"),
    DeviceSpec("rtx-4090", "NVIDIA GeForce RTX 4090", 1008, 24, 128,
               "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090: 1,008 GB/s, 24 GB GDDR6X); "
               "128 SMs", r"RTX 4090"),
    DeviceSpec("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation", 960, 48, 142,
               "NVIDIA RTX 6000 Ada Generation datasheet (960 GB/s, 48 GB GDDR6); 142 SMs",
               r"RTX 6000 Ada"),
    DeviceSpec("jetson-agx-orin", "NVIDIA Jetson AGX Orin 64GB", 204.8, 64, 16,
               "NVIDIA Jetson AGX Orin series datasheet (64GB module: 204.8 GB/s LPDDR5); "
               "2048 CUDA cores = 16 SMs", r"Orin"),
    DeviceSpec("b200", "NVIDIA B200", 8000, 192, 148,
               "NVIDIA Blackwell architecture technical brief (B200: 8 TB/s, 192 GB HBM3e; "
               "HGX B200 systems list 180 GB per GPU); 148 SMs", r"\bB200\b"),
)


# The study's names for the parts it measured (docs/study.md): a bare "h100" or "a100" is the
# part whose figures the study and this README quote.
STUDY_PARTS = {"h100": "h100-sxm5", "a100": "a100-80gb-sxm4"}


def catalogue_names() -> list[str]:
    return [d.name for d in CATALOGUE]


def did_you_mean(wanted: str, names: dict[str, str]) -> str:
    """"; did you mean 'a', 'b' or 'c'?" naming every name close to `wanted`, or "" where none
    is; `names` maps each spelling a user may type to the name to suggest. Closest first: the
    names `wanted` is a whole word of (h100 of h100-sxm5), then by the similarity of the whole
    name (difflib's ratio, 0.6 and up)."""
    import difflib

    def words(text: str) -> str:
        return "-" + "-".join(re.split(r"[\s/_-]+", text.lower())) + "-"

    ranked = []
    for spelling, name in names.items():
        whole = words(wanted) in words(spelling)
        ratio = difflib.SequenceMatcher(None, wanted.lower(), spelling.lower()).ratio()
        if whole or ratio >= 0.6:
            ranked.append((not whole, -ratio, name))
    close = [f"'{n}'" for n in dict.fromkeys(name for *_, name in sorted(ranked))]
    if not close:
        return ""
    listed = f"{', '.join(close[:-1])} or {close[-1]}" if close[1:] else close[0]
    return f"; did you mean {listed}?"


def lookup(name: str) -> DeviceSpec:
    """A catalogue entry by either name `floorline gpus` prints (h200, NVIDIA H200 SXM 141GB),
    or by the study's name of a part (STUDY_PARTS), in any case; an unknown name gets the close
    ones."""
    wanted = " ".join(name.lower().split())
    names = {}
    for device_spec in CATALOGUE:
        names[device_spec.name] = names[device_spec.full_name.lower()] = device_spec
    for alias, part in STUDY_PARTS.items():
        names[alias] = names[part]
    if wanted in names:
        return names[wanted]
    hint = did_you_mean(wanted, {k: v.name for k, v in names.items()})
    raise FloorlineError(f"unknown GPU '{name}' (known: {', '.join(catalogue_names())}){hint}")


def alias_note(name: str) -> str | None:
    """The one line saying which part a study name (STUDY_PARTS) was taken as; None for any
    other name."""
    part = STUDY_PARTS.get(" ".join(name.lower().split()))
    if part is None:
        return None
    others = [d.name for d in CATALOGUE if d.name != part
              and d.name.startswith(f"{name.lower()}-")]
    device_spec = lookup(part)
    return (f"note: '{name}' is taken as the {device_spec.full_name} ({part}, "
            f"{device_spec.peak_gbps:,g} GB/s), the part the study measured"
            + (f" (also in the catalogue: {', '.join(others)})" if others else ""))


def match_device_name(device_name: str) -> DeviceSpec | None:
    for device_spec in CATALOGUE:
        if re.search(device_spec.pattern, device_name, re.IGNORECASE):
            return device_spec
    return None


def peak_from_nvml(mem_clock_mhz: float, bus_width_bits: int) -> float:
    """Theoretical peak in GB/s from NVML's max memory clock: clock x bus width x 2 (double data
    rate, as NVML reports the clock for HBM and GDDR alike)."""
    return 2 * mem_clock_mhz * 1e6 * bus_width_bits / 8 / 1e9


def nvml_handle(nvml, index: int):
    """NVML's handle of torch's CUDA device `index`. NVML numbers every GPU of the host, torch
    only the visible ones (CUDA_VISIBLE_DEVICES, as a worker pinned to one GPU has it): they
    are matched by UUID."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return (nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid is not None
            else nvml.nvmlDeviceGetHandleByIndex(index))


def _nvml_peak(index: int) -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = nvml_handle(pynvml, index)
        clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        width = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return peak_from_nvml(clock, width)
    except Exception:  # NVML missing, or too old to report the bus width
        return None


def measure_host_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Best-of-N streaming read of a float32 buffer on the CPU, GB/s."""
    import torch

    buf = torch.rand(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def detect(device: str) -> DeviceSpec:
    """The spec of `device` ("cuda", "cuda:1", "cpu"): catalogue entry, else NVML, else measured."""
    import torch

    if device == "cpu":
        gbps = measure_host_bandwidth()
        return DeviceSpec("cpu", "host CPU", round(gbps, 1), 0, None,
                          "measured on this host: best of 5 torch.sum passes over 256 MiB "
                          "(no datasheet figure for a CPU)")
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    device_spec = match_device_name(props.name)
    if device_spec is not None:
        return device_spec
    peak = _nvml_peak(index)
    if peak is None:
        raise FloorlineError(
            f"GPU '{props.name}' is not in the catalogue and NVML cannot report its memory clock; "
            f"pass --gpu with one of: {', '.join(catalogue_names())}"
        )
    return DeviceSpec(props.name.lower().replace(" ", "-"), props.name, round(peak, 1),
                      round(props.total_memory / 1e9, 1), props.multi_processor_count,
                      "NVML: max memory clock x bus width x 2 (not a datasheet figure)")
