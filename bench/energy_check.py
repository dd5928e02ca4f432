"""The GPU's energy counter, characterised and cross-checked: how often it updates and in what
steps (idle, and under the engine's decode), then the engine's J/token over windows of several
lengths, each read three ways: the counter aligned on its updates (how floorline reads a cell),
the counter read naively at the window's edges (how floorline read it before), and the power
readings taken inside the window. Prints a table and writes it as JSON.

    PYTHONPATH=src python bench/energy_check.py \
        --json bench/results/h200-energy-check/h200_energy_check.json
"""

import argparse
import json
import statistics
import time

import torch

from floorline.measure import energy
from floorline.measure.energy import Reader, counter_period, open_meter
from floorline.models import resolve_model
from floorline.paths import open_session, parse_path

WINDOWS_S = (0.25, 0.5, 1.0, 2.0, 4.0)


def watch(meter, seconds: float) -> dict:
    """The counter's updates over `seconds` of whatever the GPU is doing."""
    reader = Reader(meter)
    time.sleep(seconds)
    reader.stop()
    return counter_period(reader.changes)


def naive(meter, step, steps: int) -> dict:
    """The counter read at the edges of `steps` steps, as floorline did before it aligned them."""
    nvml, h = meter.nvml, meter.handle
    torch.cuda.synchronize()
    t0, e0 = time.perf_counter(), nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    t1, e1 = time.perf_counter(), nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    joules = (e1 - e0) / 1e3
    return {"joules_per_token": joules / steps, "mean_watts": joules / (t1 - t0),
            "seconds": t1 - t0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--json")
    args = parser.parse_args()
    meter, note = open_meter("cuda")
    if meter is None:
        raise SystemExit(f"energy: {note}")
    out = {"model": args.model, "ctx": args.ctx, "gpu": torch.cuda.get_device_name(),
           "idle": watch(meter, 3.0)}
    spec = resolve_model(args.model)
    capacity = min(spec.max_context or args.ctx + 30_000, args.ctx + 30_000)
    session = open_session(parse_path("engine"), spec, "cuda", capacity, 0)
    session.prefill(args.ctx)
    for _ in range(500):
        session.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        session.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / 200
    out["step_ms"] = step_s * 1e3
    busy = open_meter("cuda")[0]
    reader = Reader(busy)
    for _ in range(int(3.0 / step_s)):
        session.step()
    torch.cuda.synchronize()
    reader.stop()
    out["busy"] = counter_period(reader.changes)
    out["by_window"] = []
    for window_s in WINDOWS_S:
        energy.WINDOW_MIN_S = energy.WINDOW_MAX_S = window_s
        m = open_meter("cuda")[0]
        aligned = m.metered_windows(session.step, torch.cuda.synchronize, step_s, capacity)
        naives = [naive(m, session.step, max(1, round(window_s / step_s))) for _ in range(3)]
        row = {"window_s": window_s, "aligned": aligned, "naive": naives}
        out["by_window"].append(row)
        j = [w["joules_per_token"] for w in aligned["windows"]]
        print(f"window {window_s:>5.2f} s  aligned J/token {statistics.fmean(j):.4f} "
              f"(windows {min(j):.4f}-{max(j):.4f}), {aligned['mean_watts']:.0f} W, readings "
              f"{aligned['sampled_watts'] or float('nan'):.0f} W, bound "
              f"{aligned['error_bound']:.2%}, {'valid' if aligned['valid'] else aligned['reason']}"
              f" | naive J/token {min(n['joules_per_token'] for n in naives):.4f}-"
              f"{max(n['joules_per_token'] for n in naives):.4f}, "
              f"{max(n['mean_watts'] for n in naives):.0f} W at most", flush=True)
    session.close()
    print(f"counter idle: {out['idle']}; under decode: {out['busy']}; step {out['step_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
