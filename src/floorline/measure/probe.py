"""Measured ceilings of this card, to set beside its datasheet: streaming read and copy
bandwidth, GEMV bandwidth at a model's layer shapes, kernel launch cost (eager and inside a CUDA
graph), the cost of one host synchronisation, and what the host's processor takes to run one of
the model's layers in transformers' launch-bound paths.

Buffers are rotated so that every timed pass reads memory the previous passes left out of L2.
"""

from __future__ import annotations

import os
import statistics
import time

from floorline.errors import FloorlineError, exception_line
from floorline.measure.fingerprint import fingerprint_key
from floorline.models import cut_down
from floorline.paths import REGISTRY
from floorline.store import Store
from floorline.timing import l2_bytes, rotation_copies, time_steps
from floorline.traffic import count_parameters


def _time_ms(fn, device: str, repeats: int) -> float:
    """Median ms of `fn()` over `repeats` calls, each timed on its own, after one untimed call."""
    return statistics.median(time_steps(fn, device, repeats, warmup=1))


def _rotating(buffers, op):
    state = {"i": 0}

    def fn():
        op(buffers[state["i"] % len(buffers)])
        state["i"] += 1

    return fn


def stream_read_gbps(device: str, nbytes: int, budget: int, repeats: int = 20) -> float:
    import torch

    copies = rotation_copies(nbytes, device, budget, least=2)
    bufs = [torch.rand(nbytes // 4, device=device) for _ in range(copies)]
    return nbytes / _time_ms(_rotating(bufs, torch.sum), device, repeats) / 1e6


def copy_gbps(device: str, nbytes: int, budget: int, repeats: int = 20) -> float:
    """Bytes read plus bytes written."""
    import torch

    n = rotation_copies(nbytes, device, budget // 2, least=2)
    srcs = [torch.rand(nbytes // 4, device=device) for _ in range(n)]
    dsts = [torch.empty_like(s) for s in srcs]
    pairs = list(zip(dsts, srcs))
    ms = _time_ms(_rotating(pairs, lambda p: p[0].copy_(p[1])), device, repeats)
    return 2 * nbytes / ms / 1e6


def gemv_gbps(device: str, shape: tuple[int, int], budget: int, repeats: int = 20) -> float:
    """One-row F.linear over bf16 weights of `shape` (out, in): weight bytes / time. On CUDA
    the calls over all rotated copies are captured in one graph, so launch cost is left out."""
    import torch
    import torch.nn.functional as F

    out_f, in_f = shape
    nbytes = out_f * in_f * 2
    n = rotation_copies(nbytes, device, budget, least=2)
    weights = [torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16) * 0.02
               for _ in range(n)]
    x = torch.randn(1, in_f, device=device, dtype=torch.bfloat16)
    if device.startswith("cuda"):
        F.linear(x, weights[0])  # cuBLAS handles and workspace outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                F.linear(x, w)
        return n * nbytes / _time_ms(graph.replay, device, repeats) / 1e6
    return nbytes / _time_ms(_rotating(weights, lambda w: F.linear(x, w)), device, repeats) / 1e6


def launch_us(device: str, launches: int = 2000) -> dict:
    """Per tiny kernel: from eager PyTorch (host-bound), and replayed inside a CUDA graph."""
    import torch

    x = torch.zeros(1, device=device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x.add_(1)
    sync()
    t0 = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    sync()
    result = {"eager_us": (time.perf_counter() - t0) / launches * 1e6}
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                x.add_(1)
        result["graph_us"] = _time_ms(graph.replay, device, 5) * 1e3 / launches
        t0 = time.perf_counter()
        for _ in range(launches):
            torch.cuda.synchronize()
        result["sync_us"] = (time.perf_counter() - t0) / launches * 1e6
    else:
        result["graph_us"] = result["sync_us"] = None  # no graphs and no device to wait on
    return result


# The host's time for one of the model's layers in the paths that launch every kernel from
# Python. The model's own architecture is cut to a few MB a layer (cut_down), so that the GPU's
# part of each kernel is a few microseconds and a step takes what the host needs to dispatch
# it; the difference between the steps at the two depths is the layers'. A tiny kernel's launch
# (eager_us) does not stand in for this: on lent H100s whose launches took 5.8-7.2 us, the
# study's eager step took 17.7 ms on one host and 51.7 ms on another.
HOST_PATHS = ("hf-eager", "hf-static")
HOST_DEPTHS = (1, 5)
HOST_CTX, HOST_WARMUP, HOST_STEPS, HOST_ROUNDS = 32, 16, 32, 5


def _step_ms(path: str, model_spec, device: str) -> float:
    """The median step of `path` on the model (a cut-down one) at HOST_CTX, in ms."""
    session = REGISTRY[path].open(model_spec, device, HOST_CTX + HOST_WARMUP + HOST_STEPS, 0)
    try:
        session.prefill(HOST_CTX)
        return statistics.median(time_steps(session.step, device, HOST_STEPS, HOST_WARMUP))
    finally:
        session.close()


def host_layer(device: str, model_spec) -> dict:
    """Per path of HOST_PATHS: `layer_us`, the host's time for one of the model's layers, and
    `step_us`, its time for the rest of a step (embedding, head, sampling): the medians over
    HOST_ROUNDS rounds, each timing the two depths one after the other (a busy moment of the
    host slows both), with each round's `rounds_us` [layer, rest]; or `reason` where they
    could not be read."""
    few, many = HOST_DEPTHS
    results = {}
    for path in HOST_PATHS:
        try:
            cut = {n: cut_down(model_spec, n) for n in HOST_DEPTHS}
            rounds = []
            for _ in range(HOST_ROUNDS):
                few_ms, many_ms = (_step_ms(path, cut[n], device) for n in HOST_DEPTHS)
                layer_us = (many_ms - few_ms) / (many - few) * 1e3
                rounds.append([layer_us, few_ms * 1e3 - few * layer_us])
        except Exception as e:  # an architecture transformers cannot cut down or run here
            results[path] = {"reason": f"the model cut to a few layers did not run: "
                                       f"{exception_line(e)}"}
            continue
        layer_us = statistics.median(r[0] for r in rounds)
        if layer_us <= 0:
            results[path] = {"reason": f"its step at {many} layers was not slower than at "
                                       f"{few} in most of {HOST_ROUNDS} rounds: a busy host; "
                                       f"probe again on an idle one"}
            continue
        results[path] = {"layer_us": layer_us, "step_us": statistics.median(r[1] for r in rounds),
                         "architecture": model_spec.text.model_type, "rounds_us": rounds}
    return results


def gemv_shapes(model_spec) -> list[tuple[int, int]]:
    """The distinct (out, in) shapes of the model's linears, LM head included."""
    return sorted(set(count_parameters(model_spec).matrix_shapes))


def free_bytes(device: str) -> int:
    """Memory free for new buffers: the GPU's free memory, or the host's available memory."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_buffer(device: str, buffer_mib: int) -> None:
    """The copy test holds at least two sources and two destinations at once."""
    need, free = 4 * buffer_mib * 2**20, free_bytes(device)
    if need > free:
        raise FloorlineError(f"--buffer-mib {buffer_mib} needs {need / 2**30:.1f} GiB (four "
                             f"buffers at once), more than the {free / 2**30:.1f} GiB free on "
                             f"{device}")


def probe(device: str, model_spec=None, buffer_mib: int = 1024, budget_mib: int = 8192) -> dict:
    nbytes, budget = buffer_mib * 2**20, budget_mib * 2**20
    results = {
        "stream_read_gbps": stream_read_gbps(device, nbytes, budget),
        "copy_gbps": copy_gbps(device, nbytes, budget),
        **launch_us(device),
        "method": (f"{buffer_mib} MiB buffers rotated past 4x L2 ({l2_bytes(device) / 2**20:.0f} "
                   "MiB); median of 20 timed passes; copy counts read + write; GEMV is a one-row "
                   "bf16 F.linear, replayed in a CUDA graph on GPUs"),
    }
    if model_spec is not None:
        results["model"] = model_spec.name
        results["gemv_gbps"] = {f"{o}x{i}": gemv_gbps(device, (o, i), budget)
                                for o, i in gemv_shapes(model_spec)}
        results["host_layer"] = host_layer(device, model_spec)
    return results


def probe_into(store: Store, device: str, env: dict, model_spec=None,
               buffer_mib: int = 1024) -> dict:
    """The probe of `device` (probe()), stored beside the cells of its environment `env`
    (fingerprint.environment): its figures."""
    results = probe(device, model_spec, buffer_mib=buffer_mib,
                    budget_mib=max(8 * buffer_mib, 2048))
    store.add_probe(device, results, env, fingerprint_key(env))
    return results
