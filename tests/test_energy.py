"""Energy per token from a fake NVML whose counter advances by known joules; on the CPU, energy
is said not to be measured and never shown as a number."""

import json
import time

import pytest

from conftest import run_here
from floorline.hardware import lookup
from floorline.measure import cell as cell_module
from floorline.measure import energy
from floorline.measure.ab import Plan, SessionResult, summarise_sessions
from floorline.measure.cell import measure_cell
from floorline.measure.energy import EnergyMeter, counter_period, energy_between, energy_problem
from floorline.measure.fingerprint import environment, fingerprint_key
from floorline.records import CellKey
from floorline.store import Store
from floorline.timing import StepPlan, run_plan


class FakeNVML:
    """The NVML calls the meter makes, on a fake GPU that draws `watts` while a step runs
    (`step`, which takes `step_s` of real time) and `idle_watts` otherwise. Like a real one,
    its energy counter (mJ) advances only every `period_s`; its power reading is `reported`
    (the true power where None)."""
    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 0, 0

    class NVMLError(Exception):
        pass

    def __init__(self, watts=500.0, idle_watts=100.0, period_s=0.01, step_s=0.002,
                 counter=True, reported=None, limit_w=700.0):
        self.watts, self.idle_watts = watts, idle_watts
        self.period_s, self.step_s = period_s, step_s
        self.counter, self.reported, self.limit_w = counter, reported, limit_w
        self.t0 = time.perf_counter()
        self.busy: list[tuple[float, float]] = []  # the steps' spans
        self.steps, self.running = 0, False

    def step(self):
        start = time.perf_counter()
        self.running = True
        while time.perf_counter() - start < self.step_s:
            pass
        self.running = False
        self.busy.append((start, time.perf_counter()))
        self.steps += 1

    def joules_until(self, t):
        busy = sum(min(b, t) - a for a, b in self.busy if a < t)
        return self.idle_watts * (t - self.t0) + (self.watts - self.idle_watts) * busy

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.counter:
            raise self.NVMLError("Not Supported")
        now = time.perf_counter()
        last_update = self.t0 + (now - self.t0) // self.period_s * self.period_s
        return round(self.joules_until(last_update) * 1e3)

    def nvmlDeviceGetPowerUsage(self, h):
        watts = self.reported if self.reported is not None else (
            self.watts if self.running else self.idle_watts)
        return round(watts * 1e3)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return round(self.limit_w * 1e3)

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980 if self.steps < 100 else 1755

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 40 + self.steps // 100


@pytest.fixture
def short_windows(monkeypatch):
    """Windows of a fifth of a second, power read as the mean of the last 50 ms: the checks as
    on a GPU, in a test's time."""
    monkeypatch.setattr(energy, "WINDOW_MIN_S", 0.2)
    monkeypatch.setattr(energy, "POWER_AVERAGE_S", 0.05)
    monkeypatch.setattr(energy, "SAMPLE_S", 0.005)


def windows(nvml, room=10_000):
    return EnergyMeter(nvml, None).metered_windows(nvml.step, lambda: None, nvml.step_s, room)


def test_joules_per_token_over_windows_aligned_on_the_counters_updates(short_windows):
    nvml = FakeNVML(watts=500.0, idle_watts=100.0, period_s=0.02, step_s=0.002)
    e = windows(nvml)
    assert e["valid"] and e["reason"] is None and e["method"] == "energy counter"
    assert len(e["windows"]) == energy.WINDOWS
    # A step draws 500 W for its 2 ms, 1 J, and the host's gap to the next one 100 W. The
    # windows start and end on the counter's updates, so the idle power before and after them is
    # left out; what remains is the edges' error, up to 2% here. A step the host's scheduler
    # interrupts runs longer and draws more (steps of 1.6-1.9 J on an overloaded host), so the
    # expectation is the steps' own, from the spans they took.
    spans = [b - a for a, b in nvml.busy]
    starts = [a for a, _ in nvml.busy]
    span, interval = sum(spans) / len(spans), (starts[-1] - starts[0]) / (len(starts) - 1)
    assert e["joules_per_token"] == pytest.approx(500 * span + 100 * (interval - span),
                                                  rel=0.03)
    assert e["mean_watts"] == pytest.approx(500, rel=0.02)
    assert e["joules_per_token_low"] <= e["joules_per_token"] <= e["joules_per_token_high"]
    assert e["counter"]["update_period_ms"] == pytest.approx(20, rel=0.2)
    assert 0 < e["error_bound"] < energy.ERROR_TARGET
    assert e["power_limit_w"] == 700 and e["at_start"]["sm_clock_mhz"] == 1980


def test_the_counter_read_between_updates_is_interpolated():
    changes = [(0.0, 0), (0.1, 50_000), (0.2, 150_000)]  # 500 W, then 1000 W (mJ)
    assert energy_between(changes, 0.05, 0.15) == pytest.approx(25 + 50)
    assert energy_between(changes, 0.0, 0.3) is None  # not spanned by the updates
    assert counter_period([(0.0, 0), (0.013, 10), (0.033, 30), (0.053, 31)]) == {
        "update_period_ms": pytest.approx(20), "resolution_mj": 1, "updates_seen": 3}


def test_mean_power_above_the_limit_is_not_valid(short_windows):
    e = windows(FakeNVML(watts=900.0, limit_w=700.0))
    assert not e["valid"] and "above the GPU's 700 W limit" in e["reason"]
    stored_before_the_checks = {"joules_per_token": 2.6, "mean_watts": 877.0, "power_limit_w": 700}
    assert "877 W is above" in energy_problem(stored_before_the_checks)
    unbounded = {"joules_per_token": 2.6, "mean_watts": 690.0, "power_limit_w": 700}
    assert "error is not known" in energy_problem(unbounded)
    assert energy_problem({**unbounded, "error_bound": 0.002}) is None


def test_a_counter_that_disagrees_with_the_power_readings_is_not_valid(short_windows):
    e = windows(FakeNVML(watts=500.0, reported=300.0))
    assert not e["valid"] and "disagrees with the power readings' 300 W" in e["reason"]


def test_windows_are_as_long_as_the_bound_needs_and_short_brackets_are_not_valid(
        short_windows):
    # 5 ms steps: a window must be 0.7 s (above the 0.2 s asked) for the reader's lag and the
    # step in flight at its edges to be under 1%
    e = windows(FakeNVML(step_s=0.005, period_s=0.01), room=2000)
    assert e["valid"] and all(w["seconds"] >= 0.7 for w in e["windows"])
    # an A/B arm's blocks, read between the counter's updates: 10 ms against a 10 ms period
    nvml = FakeNVML(step_s=0.002, period_s=0.01)
    meter = EnergyMeter(nvml, None)
    meter.begin()
    for _ in range(5):
        nvml.step()
    meter.end()
    e = meter.result(5)
    assert not e["valid"] and "meter longer" in e["reason"] and e["error_bound"] >= 0.01


def test_no_room_for_a_window_gives_no_reading(short_windows):
    assert windows(FakeNVML(), room=10) is None


def test_power_sampled_where_the_counter_is_missing(short_windows):
    e = windows(FakeNVML(counter=False, reported=300.0))
    assert e["method"] == "power sampled" and e["mean_watts"] == pytest.approx(300.0)
    assert e["joules_per_token"] == pytest.approx(300.0 * e["seconds"] / e["tokens"])


def test_energy_follows_timing_within_the_positions_it_leaves(short_windows):
    nvml = FakeNVML(step_s=0.001)
    t = run_plan(nvml.step, "cpu", StepPlan(4, 32), EnergyMeter(nvml, None), energy_room=5000)
    assert len(t.samples_ms) == 32 and t.energy["valid"]
    assert nvml.steps == 4 + 32 + t.energy["tokens"] and t.energy["tokens"] <= 5000


def test_the_cpu_is_not_metered():
    assert energy.open_meter("cpu") == (None, "not measured on the CPU")


def test_energy_columns_with_nvml_and_none_on_the_cpu(tmp_path, monkeypatch, short_windows):
    gpu = lookup("l4")
    key = CellKey("tiny-llama", 16, "hf-eager", 4, 1)
    env = environment("cpu")
    cpu_db, nvml_db = tmp_path / "cpu.db", tmp_path / "nvml.db"
    Store(cpu_db).add(measure_cell(key, "cpu", gpu), env, fingerprint_key(env))

    # A cell keeps the meter's reading: one valid, one above the power limit (the reading's
    # accuracy, which depends on how the host schedules the fake's steps, is tested above).
    made = [windows(FakeNVML(watts=500.0)), windows(FakeNVML(watts=900.0))]
    readings = iter(made)

    class Meter:
        def metered_windows(self, *args):
            return next(readings)

    monkeypatch.setattr(cell_module, "open_meter", lambda device: (Meter(), None))
    store = Store(nvml_db)
    for _ in range(2):
        measured = measure_cell(key, "cpu", gpu)
        store.add(measured, env, fingerprint_key(env))
    good, high = (r.details["energy"] for r in store.rows(latest=False))
    assert good["joules_per_token"] == made[0]["joules_per_token"] and high["valid"] is False
    shown = run_here("show", "--db", nvml_db, "--all", check=True).stdout
    assert "J/token" in shown and "(700)" in shown
    assert f"{good['joules_per_token']:.4g} ({good['joules_per_token_low']:.4g}-" in shown
    assert "not valid" in shown and "above the GPU's 700 W limit" in " ".join(shown.split())
    shown = run_here("show", "--db", cpu_db, check=True).stdout
    assert "J/token" not in shown and "energy per token: not measured on the CPU" in shown
    row = json.loads(run_here("show", "--db", cpu_db, "--json", check=True).stdout)[0]
    assert "energy" not in row["details"]
    assert row["details"]["energy_note"] == "not measured on the CPU"


def session(index, ms_a, ms_b, j_a=None, j_b=None):
    e = lambda j: None if j is None else {"joules_per_token": j, "error_bound": 0.002}  # noqa: E731
    return SessionResult(index, "ok", None, "a", [ms_a], [ms_b], [64, 64], e(j_a), e(j_b),
                         None if j_a and j_b else "not measured on the CPU")


def test_ab_energy_ratio_over_sessions_with_both_arms():
    plan = Plan("hf-static", "hf-static+graphs", "m", 8, "cuda", "h200", sessions=4)
    s = summarise_sessions(plan, [session(0, 2.0, 1.0, 1.2, 1.0), session(1, 2.0, 1.0, 1.5, 1.0),
                                  session(2, 2.0, 1.0, 0.9, 1.0), session(3, 2.0, 1.0, 2.0, None)])
    assert s.energy.estimate == pytest.approx((1.2 + 1.5 + 0.9) / 3) and s.energy.n == 3
    assert s.energy.low < s.energy.estimate < s.energy.high
    d = s.as_dict()
    assert d["energy_ratio"] == pytest.approx(1.2) and d["per_session"][3]["energy_ratio"] is None
    assert "energy per token hf-static/hf-static+graphs 1.200 (95% CI" in d["sentence"]


def test_ab_without_energy_says_so():
    plan = Plan("hf-eager", "hf-static", "m", 8, "cpu", "l4", sessions=2)
    s = summarise_sessions(plan, [session(0, 2.0, 1.0), session(1, 3.0, 1.0)])
    assert s.energy is None and s.as_dict()["energy_ratio"] is None
    assert s.sentence().endswith("energy per token not measured on the CPU")


def test_report_draws_energy_against_time_per_path(tmp_path):
    from floorline.records import VALID, CellResult
    from floorline.report.build import build_report

    db = tmp_path / "r.db"
    store = Store(db)
    for i, (path, ms, joules) in enumerate((("engine", 3.0, 1.5), ("hf-eager", 20.0, 7.0),
                                           ("hf-eager", 25.0, None))):
        details = {"energy": {"joules_per_token": joules, "error_bound": 0.002}} if joules else {
            "energy_note": "not measured on the CPU"}
        store.add(CellResult(CellKey("tiny-llama", 128 * (i + 1), path, 8, 2), "l4", VALID, None,
                             [ms] * 8, {"median_ms": ms, "p10_ms": ms, "p90_ms": ms,
                                        "mean_ms": ms, "n": 8},
                             {"floor_ms": 1.0, "total_bytes": 10**6, "peak_gbps": 300,
                              "weight_format": "bf16", "kv_dtype": "bf16"}, details),
                  {"device": "test"}, "env")
    written = build_report(db, tmp_path / "out")
    assert "fig7_energy.png" in written["figures"]
    assert not any("energy" in m for m in written["missing"])
    assert "Drawn from cells 1, 2 of this database" in (tmp_path / "out" / "report.md").read_text()

    empty = tmp_path / "cpu.db"
    Store(empty).close()
    written = build_report(empty, tmp_path / "out2")
    assert "figure 7: No cell here has a valid energy per token" in "\n".join(written["missing"])


def test_readings_a_gpu_does_not_report_are_left_out(short_windows):
    nvml = FakeNVML()

    def unsupported(*args):
        raise FakeNVML.NVMLError("Not Supported")

    nvml.nvmlDeviceGetEnforcedPowerLimit = nvml.nvmlDeviceGetTemperature = unsupported
    e = windows(nvml)
    assert e["valid"] and e["power_limit_w"] is None
    assert e["at_start"] == {"sm_clock_mhz": 1980, "temperature_c": None}
    from floorline.cli.render import energy_columns

    assert energy_columns(e)[1].endswith("(-)") and energy_columns(e)[3] == "-"


def test_positions_for_energy_only_where_they_leave_the_timed_steps_as_they_were():
    """hf-static attends over its whole static cache: room for energy windows would slow the
    steps it times, unless its session rewinds; one of a sliding-window model cannot, and gets
    none. A rewinding session's windows take no more positions."""
    from floorline.measure.cell import prepare_cell
    from floorline.models import resolve_model

    # (model, path, energy reserved, rewound every, the session's positions past the prompt:
    # a rewinding one 64 after the graph's 3 warm-up steps, else the plan's 512 + 64 and the
    # energy's)
    for model, path, reserved, window, room in (
            ("qwen2.5-7b", "hf-static+graphs", True, 64, 3 + 64),
            ("tiny-mistral-swa", "hf-static", False, None, 512 + 64),
            ("qwen2.5-7b", "engine", True, 64, 64)):
        cell, run = prepare_cell(CellKey(model, 256, path, 64, "auto"), resolve_model(model),
                                 "cuda", lookup("h200"), 0)
        energy = cell.details.get("positions_for_energy", 0)
        assert (energy > 0) is reserved, path
        assert cell.details.get("rewound_every") == run.budget.window == window, path
        assert run.budget.positions == 256 + room + (0 if window else energy), path
    spec = resolve_model("qwen2.5-7b")
    cell, _ = prepare_cell(CellKey("qwen2.5-7b", 2048, "engine", 64, "auto"), spec, "cpu",
                           lookup("h200"), 0)
    assert "positions_for_energy" not in cell.details  # the CPU is not metered
