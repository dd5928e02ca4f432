"""The host's load around a cell, read at its start and its end: what else was running while it
was timed. Cheap (a few reads, no waiting) and never a cell's failure: whatever cannot be read
is left out.

A cell's details["host_load"] holds {"start": ..., "end": ...}, each host_load()'s dict:
  load_1min, cpus        the 1-minute load average and the number of CPUs (os.getloadavg,
                         os.cpu_count)
  cpu_ticks              /proc/stat's aggregate CPU counters (total, idle, steal), where it exists
  cpu_busy, cpu_steal    at the end: the share of CPU time busy and stolen by the hypervisor
                         between the two reads (the cell's own work included in busy)
  gpu_processes          on CUDA: the other processes on the cell's GPU (NVML), pid and MiB
"""

from __future__ import annotations

import os

from floorline.interruptions import MIN_TICKS, cpu_ticks

# The host is busy, and a cell's details["host_warning"] says so, where any of these holds:
# the 1-minute load average, at the start or the end, above LOAD_PER_CPU x the number of CPUs
# (more runnable threads than CPUs: something waits, the cell's host thread perhaps);
LOAD_PER_CPU = 1.0
# over MAX_STEAL of the CPU time between the two reads stolen by the hypervisor (a shared VM);
MAX_STEAL = 0.05
# any other process on the cell's GPU (it shares the memory bandwidth the floor counts on).

def cpu_use() -> dict | None:
    """The host's CPU ticks (cpu_ticks) and this process's own CPU seconds, all its threads',
    now; None where the ticks cannot be read."""
    ticks = cpu_ticks()
    if ticks is None:
        return None
    own = os.times()
    return {**ticks, "own_s": own.user + own.system}


def others_share(start: dict | None, end: dict | None) -> float | None:
    """The share of the host's CPU time between two cpu_use() reads that other processes took:
    the busy time less this process's own; None where either read is missing or they are
    under MIN_TICKS apart."""
    if not start or not end:
        return None
    total = end["total"] - start["total"]
    if total < MIN_TICKS:
        return None
    busy = total - (end["idle"] - start["idle"]) - (end["steal"] - start["steal"])
    own = (end["own_s"] - start["own_s"]) * os.sysconf("SC_CLK_TCK")
    return round(min(1.0, max(0.0, (busy - own) / total)), 4)


def spare_share(threads: int) -> float:
    """The share of the host's CPU time that a process of `threads` busy threads leaves free:
    what others may take without taking its cores."""
    cpus = os.cpu_count() or 1
    return round(max(0, cpus - threads) / cpus, 4)


def _nvml_processes(index: int):
    """(pid, used MiB) of every compute process on torch's CUDA device `index`."""
    import pynvml

    from floorline.hardware import nvml_handle

    pynvml.nvmlInit()
    handle = nvml_handle(pynvml, index)
    return [(p.pid, None if p.usedGpuMemory is None else round(p.usedGpuMemory / 2**20))
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]


def gpu_processes(device: str) -> dict | None:
    """The processes on `device`'s GPU other than this one and its parent (the sweep that
    started it): {"others": [{"pid", "mib"}...], "count": n}. Where NVML lists PIDs of another
    namespace (a container), this process cannot be told apart: then "count" is the number
    listed less one while this process holds a CUDA context, and "own_pid_unseen" is true.
    None off CUDA or where NVML cannot say."""
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        index = torch.device(device).index or 0
        listed = _nvml_processes(index)
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        holding = bool(has_context(index)) if has_context else torch.cuda.is_initialized()
    except Exception:  # NVML missing, too old, or no permission: nothing to say
        return None
    mine = {os.getpid(), os.getppid()}
    others = [{"pid": pid, "mib": mib} for pid, mib in listed if pid not in mine]
    out = {"others": others, "count": len(others)}
    if holding and listed and not any(pid == os.getpid() for pid, _ in listed):
        out.update(count=len(listed) - 1, own_pid_unseen=True)
    return out


def host_load(device: str, since: dict | None = None) -> dict:
    """The host's load now, JSON-able; with `since` (the cell's start), the CPU time busy and
    stolen between the two."""
    out: dict = {"cpus": os.cpu_count()}
    try:
        out["load_1min"] = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # no load average on this system
        pass
    ticks = cpu_ticks()
    if ticks is not None:
        out["cpu_ticks"] = ticks
        before = (since or {}).get("cpu_ticks")
        total = ticks["total"] - before["total"] if before else 0
        if total > 0:
            out["cpu_busy"] = round((total - (ticks["idle"] - before["idle"])
                                     - (ticks["steal"] - before["steal"])) / total, 4)
            out["cpu_steal"] = round((ticks["steal"] - before["steal"]) / total, 4)
    gpu = gpu_processes(device)
    if gpu is not None:
        out["gpu_processes"] = gpu
    return out


def host_warning(start: dict, end: dict) -> str | None:
    """One sentence where the host was busy around the cell (the rule above), with its figures;
    None where it was not, or nothing could be read."""
    busy = []
    loads = [(when, r["load_1min"], r["cpus"]) for when, r in (("start", start), ("end", end))
             if r.get("load_1min") is not None and r.get("cpus")]
    high = [f"{load:g} at its {when}" for when, load, cpus in loads if load > LOAD_PER_CPU * cpus]
    if high:
        busy.append(f"the 1-minute load average was {' and '.join(high)}, above its "
                    f"{loads[0][2]} CPUs")
    steal = end.get("cpu_steal")
    if steal is not None and steal > MAX_STEAL:
        busy.append(f"the hypervisor took {steal:.1%} of the CPU time (over {MAX_STEAL:.0%})")
    gpu = max((r.get("gpu_processes") or {"count": 0} for r in (start, end)),
              key=lambda g: g["count"])
    if gpu["count"] > 0:
        pids = ", ".join(f"pid {p['pid']}" + (f" ({p['mib']} MiB)" if p["mib"] is not None
                                                else "") for p in gpu["others"])
        busy.append(f"{gpu['count']} other process(es) held the GPU"
                    + (f": {pids}" if pids and not gpu.get("own_pid_unseen") else ""))
    if not busy:
        return None
    return (f"the host was busy during this cell: {'; '.join(busy)}. Its figures may be slower "
            f"and noisier than on an idle host.")
