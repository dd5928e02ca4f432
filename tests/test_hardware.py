import pytest

from floorline.errors import FloorlineError
from floorline.hardware import CATALOGUE, alias_note, lookup, match_device_name, peak_from_nvml

REQUIRED = ["h100-sxm5", "h100-pcie", "h200", "a100-80gb-sxm4", "a100-40gb", "l40s", "l4", "a10g",
            "rtx-4090", "rtx-6000-ada", "jetson-agx-orin", "b200"]


def test_catalogue_has_the_required_gpus_with_sources():
    names = [g.name for g in CATALOGUE]
    assert set(REQUIRED) <= set(names)
    assert len(names) == len(set(names))
    for g in CATALOGUE:
        assert g.peak_gbps > 0 and g.memory_gb > 0 and g.sms > 0
        assert len(g.source) > 20, g.name


def test_study_bandwidths():
    # The study's GPU set, as its page lists them (3350, 2039, 864, 300 GB/s).
    names = ("h100-sxm5", "a100-80gb-sxm4", "l40s", "l4")
    assert [lookup(n).peak_gbps for n in names] == [3350, 2039, 864, 300]


@pytest.mark.parametrize("torch_name, expected", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm5"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", None),           # 94 GB, 3.9 TB/s: not catalogued, NVML decides
    ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm4"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", None),     # 1935 GB/s, not the SXM part
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L40", None),
    ("NVIDIA L4", "l4"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
    ("Orin", "jetson-agx-orin"),
    ("NVIDIA B200", "b200"),
    ("Tesla T4", None),
])
def test_detection_by_device_name(torch_name, expected):
    spec = match_device_name(torch_name)
    assert (spec.name if spec else None) == expected


def test_nvml_peak_reproduces_datasheets():
    # NVML's max memory clock x bus width x 2, on clocks these cards report.
    assert peak_from_nvml(2619, 5120) == pytest.approx(3352, rel=1e-3)  # H100 SXM5
    assert peak_from_nvml(10501, 384) == pytest.approx(1008, rel=1e-3)  # RTX 4090
    assert peak_from_nvml(6251, 192) == pytest.approx(300, rel=1e-3)  # L4


def test_unknown_gpu_name():
    with pytest.raises(FloorlineError, match="unknown GPU 'h300'"):
        lookup("h300")
    assert lookup("H200").name == "h200"


@pytest.mark.parametrize("name, suggested", [
    # the names it is a whole word of first (a100-80gb-sxm4, ...), then by similarity
    ("80gb", "'a100-80gb-sxm4', 'h100-pcie' or 'h100-sxm5'"),
    ("A100-80GB", "'a100-80gb-sxm4', 'a100-40gb' or 'a10g'"),
    ("4090", "'rtx-4090'"),
    ("h20", "'h200'"),
])
def test_unknown_gpu_suggests_every_close_name_closest_first(name, suggested):
    with pytest.raises(FloorlineError, match=rf"; did you mean {suggested}\?$"):
        lookup(name)


def test_no_suggestion_where_no_name_is_close():
    with pytest.raises(FloorlineError) as refused:
        lookup("tpu-v5")
    assert "did you mean" not in str(refused.value)


def test_nvml_handle_is_the_visible_gpus_not_nvmls_index(monkeypatch):
    # A worker pinned to the host's third GPU (CUDA_VISIBLE_DEVICES=2) sees it as torch device
    # 0; NVML's device 0 is the host's first GPU. The handle must be the third's, by UUID.
    import torch

    from floorline.hardware import nvml_handle

    class Props:
        uuid = "3c1f0e2a-0000-0000-0000-000000000002"

    class FakeNVML:
        def nvmlDeviceGetHandleByUUID(self, uuid):
            return ("uuid", uuid)

        def nvmlDeviceGetHandleByIndex(self, index):
            return ("index", index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    assert nvml_handle(FakeNVML(), 0) == ("uuid", "GPU-3c1f0e2a-0000-0000-0000-000000000002")
    Props.uuid = None  # a torch too old to report the UUID: NVML's index, as before
    assert nvml_handle(FakeNVML(), 0) == ("index", 0)


@pytest.mark.parametrize("name, part", [("h100", "h100-sxm5"), ("A100", "a100-80gb-sxm4")])
def test_the_studys_names_are_the_parts_it_measured(name, part):
    assert lookup(name).name == part
    assert f"the {lookup(part).full_name} ({part}," in alias_note(name)
    assert alias_note(part) is None and alias_note("h200") is None


def test_a_study_name_says_which_part_it_took(cli):
    for argv in (["floor", "--model", "qwen2.5-7b", "--gpu", "h100", "--ctx", "2048"],
                 ["predict", "--model", "qwen2.5-7b", "--gpu", "h100", "--ctx", "2048",
                  "--path", "engine"]):
        done = cli(*argv, check=True)
        assert "h100-sxm5" in done.stdout
        notes = [line for line in done.stderr.splitlines() if line.startswith("note:")]
        assert notes == [alias_note("h100")], done.stderr
