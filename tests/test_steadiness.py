"""Steady, or flagged, or refused: an unsteady cell keeps its figures but is left out of every
figure and fit; the host's load around each cell; explain splits what the profiler stretched and
refuses only a split it cannot make; the CPU's floor is marked as measured."""

import dataclasses
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from floorline import cli, interruptions
from floorline.cli import render
from floorline.forecast.calibration import from_rows
from floorline.hardware import lookup
from floorline.measure import cell as cell_module
from floorline.measure import explain as explain_module
from floorline.measure import host
from floorline.measure.cell import measure_cell
from floorline.measure.explain import (
    by_class,
    decompose,
    explain,
    profiler_scale,
    split_problem,
)
from floorline.measure.runner import ChildFailed
from floorline.measure.steadiness import MAX_DRIFT, MAX_SPREAD, unsteady_reason
from floorline.records import UNSTEADY, VALID, CellKey, CellResult
from floorline.report.headline import ladder
from floorline.store import Store
from floorline.timing import Timing, drift

STEADY = {"warmup_steps": 64, "timed_steps": 64, "drift": 1.001, "steady": True}


def summary(median, p10, p90):
    return {"n": 64, "median_ms": median, "p10_ms": p10, "p90_ms": p90, "mean_ms": median}


# --- the rule ---------------------------------------------------------------------------------

def test_a_steady_cell_is_not_flagged():
    assert unsteady_reason(STEADY, summary(4.0, 3.99, 4.01)) is None
    # A fixed warm-up asserts nothing about steadiness; drift and spread just inside the bounds.
    inside = {"warmup_steps": 8, "drift": MAX_DRIFT - 0.01, "steady": None}
    assert unsteady_reason(inside, summary(10.0, 8.0, 8.0 + 10 * MAX_SPREAD - 0.01)) is None
    assert unsteady_reason({**inside, "drift": 1 / MAX_DRIFT + 0.01}, summary(1, 1, 1)) is None
    # Too few steps for a drift (None) is no failure; under 32 steps, one slow step is no
    # evidence of a busy host, but a warm-up that never settled still is.
    assert unsteady_reason({"warmup_steps": 0, "drift": None}, summary(1, 1, 1)) is None
    few = {**summary(1.0, 1.0, 9.0), "n": 5}
    assert unsteady_reason({"warmup_steps": 1, "drift": 9.0, "steady": None}, few) is None
    assert "stopped at its cap" in unsteady_reason({"warmup_steps": 512, "drift": 9.0,
                                                    "steady": False}, few)


def test_the_loaded_cpu_demo_is_flagged_with_its_figures():
    # What a loaded CPU demo once stored as valid: engine 0.74 ms, p10-p90 0.59-225.06, drift 261.
    reason = unsteady_reason({**STEADY, "drift": 261.23}, summary(0.74, 0.59, 225.06))
    assert "drift 261.230, bound 0.80-1.25" in reason
    assert "p10-p90 0.59-225 ms spans 30334% of its median 0.74 ms (bound 50%)" in reason
    assert "idle host" in reason and "`floorline sweep`" in reason


def test_a_warm_up_that_never_settled_is_flagged():
    # The H200 hf-eager cell whose automatic warm-up reached its cap: drift 1.133, spread 0.21.
    details = {"warmup_steps": 512, "drift": 1.133, "steady": False}
    reason = unsteady_reason(details, summary(60.85, 55.0, 67.5))
    assert "warm-up stopped at its cap after 512 steps" in reason
    assert "drift" not in reason and "spans" not in reason  # the bounds that held are not named
    assert "`--warmup N`, N above 512" in reason


def test_a_warm_up_cut_to_two_windows_is_judged_by_its_timed_steps():
    # At ctx 131072 the model's positions left room for two windows of warm-up: one comparison,
    # a cold window against the next. An engine cell that failed it timed steadily.
    cut = {"warmup_steps": 64, "drift": 0.988, "steady": False,
           "warmup_rule": {"window": 32, "tolerance": 0.01, "cap": 64, "cap_s": 5.0}}
    assert unsteady_reason(cut, summary(7.252, 7.2, 7.42)) is None
    assert "drift 0.700" in unsteady_reason({**cut, "drift": 0.7}, summary(7.252, 7.2, 7.42))
    full = {**cut, "warmup_rule": {**cut["warmup_rule"], "cap": 512}}
    assert "stopped at its cap" in unsteady_reason(full, summary(7.252, 7.2, 7.42))


def test_a_step_still_speeding_up_is_told_to_warm_up_longer():
    reason = unsteady_reason({"warmup_steps": 8, "drift": 0.63, "steady": None},
                             summary(34.1, 33.0, 35.0))
    assert "took 0.63x the first quarter's median (drift 0.630" in reason
    assert "`--warmup N`, N above 8" in reason
    slower = unsteady_reason({"warmup_steps": 8, "drift": 1.81, "steady": None},
                             summary(34.1, 33.0, 35.0))
    assert "drift 1.810" in slower and "--warmup" not in slower  # warming up longer won't help


def test_a_drift_its_quarters_noise_explains_is_no_trend():
    # A drift of 1.30 where the quarters' own noise allows 0.31 either way is not flagged;
    # where it allows 0.10 (the H100 host's static-cache sweep cell), it is.
    noisy = {**STEADY, "drift": 1.30, "drift_noise": 0.31}
    assert unsteady_reason(noisy, summary(26.0, 23.6, 34.0)) is None
    reason = unsteady_reason({**noisy, "drift_noise": 0.10}, summary(26.0, 23.6, 34.0))
    assert ("(drift 1.300, bound 0.80-1.25; its quarters' own noise allows 0.10 either way)"
            in reason)
    assert "drift 1.300, bound 0.80-1.25)" in unsteady_reason(
        {**STEADY, "drift": 1.30}, summary(26.0, 23.6, 34.0))  # stored before the noise was


def test_a_wide_spread_is_valid_where_the_timing_settled_its_median():
    wide = summary(26.0, 23.6, 45.0)  # 82% of the median
    auto = {**STEADY, "timed_steps": 1400, "median_ci_ms": [25.6, 26.4], "width_reached": True,
            "steps_rule": {"rel_width": 0.04, "confidence": 0.95, "cap": 2048}}
    assert unsteady_reason(auto, {**wide, "n": 1400}) is None
    cut = {**auto, "timed_steps": 2048, "median_ci_ms": [24.0, 28.0], "width_reached": False}
    reason = unsteady_reason(cut, {**wide, "n": 2048})
    assert "stopped at its cap of 2048" in reason and "spans 82% of its median" in reason
    fixed = unsteady_reason(STEADY, wide)
    assert "spans 82%" in fixed and "or time it until its median settles (`--steps auto`" in fixed


# --- a cell measured on a noisy host ----------------------------------------------------------

def noisy_samples():
    """64 steps: 1 ms, then the host got busy: the last half at 3 ms, one step at 200 ms."""
    samples = [1.0] * 32 + [3.0] * 31 + [200.0]
    assert drift(samples) == 3.0
    return samples


def fake_timing(samples, steady=True):
    def run_plan(step, device, plan, meter=None, energy_room=0):
        return Timing(list(samples), 64, steady)
    return run_plan


def test_an_unsteady_cell_keeps_its_figures_and_says_why(monkeypatch):
    monkeypatch.setattr(cell_module, "run_plan", fake_timing(noisy_samples()))
    cell = measure_cell(CellKey("tiny-llama", 16, "hf-eager", 64, "auto"), "cpu", lookup("l4"))
    assert cell.status == UNSTEADY
    assert "drift 3.000, bound 0.80-1.25" in cell.reason
    assert cell.samples_ms == noisy_samples() and cell.summary["median_ms"] == 2.0
    assert cell.details["drift"] == 3.0 and cell.floor["floor_ms"] > 0
    # The host's load around it, recorded whatever it was.
    load = cell.details["host_load"]
    assert load["start"]["cpus"] >= 1 and "load_1min" in load["end"]


def test_a_steady_cell_is_valid(monkeypatch):
    monkeypatch.setattr(cell_module, "run_plan", fake_timing([1.0, 1.01, 0.99, 1.0] * 16))
    cell = measure_cell(CellKey("tiny-llama", 16, "hf-eager", 64, "auto"), "cpu", lookup("l4"))
    assert cell.status == VALID and cell.reason is None


def stored(store, path, median, status=VALID, reason=None, gpu="h200", p90=None):
    s = summary(median, median, p90 or median)
    return store.add(CellResult(CellKey("qwen2.5-7b", 2048, path, 64, "auto"), gpu, status, reason,
                                [median] * 64, s,
                                {"floor_ms": 3.0, "total_bytes": 10**9, "peak_gbps": 4800,
                                 "weight_format": "bf16", "kv_dtype": "bf16"},
                                {"drift": 1.0, "peak_source": "datasheet"}),
                     {"device": "test"}, "env")


@pytest.fixture
def mixed_db(tmp_path):
    """A valid engine cell and an unsteady hf-eager one."""
    store = Store(tmp_path / "m.db")
    stored(store, "engine", 4.0)
    stored(store, "hf-eager", 60.0, UNSTEADY, "its p10-p90 ... (bound 50%)", p90=95.0)
    return store


def test_an_unsteady_cell_is_left_out_of_the_headline(mixed_db):
    (panel,) = ladder(mixed_db.rows(latest=False))
    assert [b["path"] for b in panel["bars"]] == ["engine"]


def test_an_unsteady_cell_is_left_out_of_the_forecast_calibration(mixed_db):
    cal = from_rows(mixed_db.rows(), [], {}, "db")
    assert [c["path"] for c in cal.cells] == ["engine"]


def test_an_unsteady_cell_is_measured_again_by_the_next_sweep(mixed_db):
    assert mixed_db.has_valid(CellKey("qwen2.5-7b", 2048, "engine", 64, "auto"), "env")
    assert not mixed_db.has_valid(CellKey("qwen2.5-7b", 2048, "hf-eager", 64, "auto"), "env")


def test_show_prints_an_unsteady_row_with_its_figures(mixed_db):
    result = CliRunner().invoke(cli.app, ["show", "--db", str(mixed_db.path)])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "hf-eager" in line)
    assert "unsteady" in row and "60.00" in row and "60.00-95.00" in row
    assert render.status_label(UNSTEADY) == "[yellow]unsteady[/]"
    assert render.status_label("invalid") == "[red]invalid[/]"
    assert render.status_label(VALID) == VALID


# --- the host's load --------------------------------------------------------------------------

def test_the_host_load_has_its_fields():
    start = host.host_load("cpu")
    end = host.host_load("cpu", since=start)
    json.dumps({"start": start, "end": end})  # JSON-able
    assert start["cpus"] >= 1 and isinstance(start["load_1min"], float)
    assert "gpu_processes" not in start  # off CUDA
    if "cpu_ticks" in start:  # Linux: the shares of the ticks between the reads, where any passed
        assert set(start["cpu_ticks"]) == {"total", "idle", "steal"}
        assert "cpu_busy" not in start
        if end["cpu_ticks"]["total"] > start["cpu_ticks"]["total"]:
            assert 0 <= end["cpu_busy"] <= 1 and 0 <= end["cpu_steal"] <= 1


def test_a_planted_high_load_is_a_warning(monkeypatch):
    monkeypatch.setattr(host.os, "getloadavg", lambda: (9.5, 1.0, 1.0))
    monkeypatch.setattr(host.os, "cpu_count", lambda: 4)
    start = host.host_load("cpu")
    end = host.host_load("cpu", since=start)
    warning = host.host_warning(start, end)
    assert "load average was 9.5 at its start and 9.5 at its end, above its 4 CPUs" in warning
    monkeypatch.setattr(host.os, "getloadavg", lambda: (3.9, 1.0, 1.0))
    assert host.host_warning(host.host_load("cpu"), host.host_load("cpu")) is None


def test_stolen_cpu_time_and_other_gpu_processes_are_warnings(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    monkeypatch.setattr(interruptions, "PROC_STAT", str(stat))
    stat.write_text("cpu  100 0 100 700 0 0 0 100 0 0\ncpu0 1 1 1 1\n")
    start = host.host_load("cpu")
    assert start["cpu_ticks"] == {"total": 1000, "idle": 700, "steal": 100}
    stat.write_text("cpu  200 0 200 1500 0 0 0 100 0 0\n")  # 1000 more ticks, 0 stolen
    assert host.host_load("cpu", since=start)["cpu_steal"] == 0.0
    stat.write_text("cpu  200 0 200 1400 0 0 0 200 0 0\n")  # 1000 more ticks, 100 stolen
    end = host.host_load("cpu", since=start)
    assert end["cpu_busy"] == 0.2 and end["cpu_steal"] == 0.1
    assert "the hypervisor took 10.0% of the CPU time (over 5%)" in host.host_warning(start, end)
    stat.unlink()  # no /proc/stat: no ticks, no shares, no failure
    assert "cpu_ticks" not in host.host_load("cpu")

    monkeypatch.setattr(host, "_nvml_processes", lambda index: [(4242, 30000), (host.os.getpid(),
                                                                                1000)])
    processes = host.gpu_processes("cuda")
    if processes is not None:  # torch present: NVML's list, this process left out
        assert processes["count"] == 1 and processes["others"] == [{"pid": 4242, "mib": 30000}]
    quiet = {"cpus": 4, "load_1min": 0.1}
    busy = {**quiet, "gpu_processes": {"others": [{"pid": 4242, "mib": 30000}], "count": 1}}
    assert "1 other process(es) held the GPU: pid 4242 (30000 MiB)" in host.host_warning(quiet,
                                                                                          busy)
    assert host.host_warning(quiet, {**quiet, "gpu_processes": {"others": [], "count": 0}}) is None


def test_nvml_that_fails_is_no_failure(monkeypatch):
    def broken(index):
        raise RuntimeError("NVML Shared Library Not Found")
    monkeypatch.setattr(host, "_nvml_processes", broken)
    assert host.gpu_processes("cuda") is None
    assert "gpu_processes" not in host.host_load("cuda")


def test_sweep_prints_the_warning_in_yellow():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, color_system="standard", width=300)
    cell = CellResult(CellKey("m", 16, "hf-eager", 8, 2), "l4", VALID,
                      details={"host_warning": "the host was busy during this cell: [x]"})
    render.print_cell_notes(console, cell, "m ctx=16 hf-eager")
    text = buffer.getvalue()
    assert "\x1b[33m" in text and "busy host: m ctx=16 hf-eager: the host was busy" in text
    assert "[x]" in text  # a warning's text is not read as markup
    buffer.seek(0), buffer.truncate()
    render.print_cell_notes(console, CellResult(cell.key, "l4", UNSTEADY, "drift 3.000"), "m")
    assert "\x1b[33munsteady: m: drift 3.000" in buffer.getvalue()


# --- explain splits what the profiler stretched, and refuses only an unusable split ----------

# Two steps of a GEMV (4 us) and an elementwise kernel (2 us): 6 us of kernels a step, on a
# profiled timeline of 9 us a step.
STRETCHED = [("gemv2T_kernel", 0, 4, 4), ("elementwise_add", 6, 8, 2),
             ("gemv2T_kernel", 10, 14, 4), ("elementwise_add", 16, 18, 2)]


@pytest.mark.parametrize("median_ms, scale", [(0.008, 1.0), (0.006, 1.0),
                                               (0.0045, 0.0045 / 0.009)])
def test_a_gpu_step_is_split_however_the_profiler_stretched_it(median_ms, scale):
    # Kernels that fit the unprofiled median keep their times (the profiler's cost was in the
    # gaps); kernels busy for longer than it are scaled with the timeline, and no share is
    # negative either way.
    assert profiler_scale(STRETCHED, 2, median_ms, "cuda") == pytest.approx(scale)
    d = decompose(by_class(STRETCHED, 2, {}, scale), STRETCHED, steps=2, median_ms=median_ms,
                  floor_ms=0.001, scale=scale)
    assert d["launch_and_idle_ms"] == pytest.approx(median_ms - 0.006 * scale)
    assert d["launch_and_idle_ms"] >= 0 and split_problem(d) is None
    assert d["profiler_us_per_kernel"] == pytest.approx((9 - median_ms * 1e3) / 2)


def test_a_cpu_step_is_always_scaled_to_its_median():
    assert profiler_scale(STRETCHED, 2, 0.008, "cpu") == pytest.approx(0.008 / 0.009)


def test_kernels_faster_than_the_floor_are_refused():
    d = decompose(by_class(STRETCHED, 2, {}), STRETCHED, steps=2, median_ms=0.01, floor_ms=0.003)
    assert split_problem(d) is None
    d = decompose(by_class(STRETCHED, 2, {}), STRETCHED, steps=2, median_ms=0.01, floor_ms=0.005)
    assert split_problem(d) == (
        "the matrix-vector and attention kernels took 0.004 ms a step, less than the floor of "
        "0.005 ms: their bytes did not all come from memory (a model small enough to stay in "
        "the cache), so the step cannot be split against the floor")


def test_explain_refuses_instead_of_printing_negatives(monkeypatch):
    def cached(model_spec, gpu, ctx, weight_format, kv_dtype):  # a floor of many more bytes
        f = real_floor(model_spec, gpu, ctx, weight_format, kv_dtype)
        return dataclasses.replace(f, floor_ms=f.floor_ms * 1e6)
    real_floor = explain_module.floor
    monkeypatch.setattr(explain_module, "floor", cached)
    with pytest.raises(explain_module.FloorlineError, match="did not all come from memory"):
        explain("tiny-llama", 16, "hf-eager", "cpu", lookup("l4"), steps=2, warmup=1)


def test_the_explain_command_refuses_in_one_line_and_stores_nothing(monkeypatch, tmp_path):
    line = ("the matrix-vector and attention kernels took 0.004 ms a step, less than the floor "
            "of 0.005 ms: their bytes did not all come from memory (a model small enough to stay "
            "in the cache), so the step cannot be split against the floor")

    def refused(*args, **kwargs):
        raise ChildFailed(line)  # what the runner makes of the child's FloorlineError
    monkeypatch.setattr(explain_module, "explain_in_child", refused)
    db = tmp_path / "e.db"
    result = CliRunner().invoke(cli.app, ["explain", "--model", "tiny-llama", "--ctx", "16",
                                          "--path", "hf-eager", "--device", "cpu", "--gpu", "l4",
                                          "--db", str(db)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"explaining hf-eager at ctx 16 failed: {line}" in " ".join(result.output.split())
    assert "-" not in result.stdout.replace("hf-eager", "")  # no share printed, negative or not
    assert Store(db, read_only=True).explanations() == []


# --- the CPU's floor --------------------------------------------------------------------------

def test_a_cpu_cells_floor_is_marked_measured(tmp_path):
    store = Store(tmp_path / "cpu.db")
    store.add(CellResult(CellKey("tiny-llama", 16, "hf-eager", 8, 2), "cpu", VALID, None, [2.0],
                         summary(2.0, 2.0, 2.0),
                         {"floor_ms": 0.125, "total_bytes": 10**6, "peak_gbps": 31.0,
                          "weight_format": "bf16", "kv_dtype": "bf16"},
                         {"peak_source": "measured on this host: best of 5 torch.sum passes"}),
              {"device": "cpu: test"}, "env")
    stored(store, "engine", 4.0)  # a GPU cell: the datasheet's floor, unmarked
    result = CliRunner().invoke(cli.app, ["show", "--db", str(store.path)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "0.125*" in out and "3.000*" not in out and "3.000" in out
    assert "floor ms *: at the read bandwidth its sweep measured on this host (31 GB/s)" in out
