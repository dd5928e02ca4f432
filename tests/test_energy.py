"""Energy per token from a fake NVML whose counter advances by known joules; on the CPU, energy
is said not to be measured and never shown as a number."""

import json

import pytest

from conftest import run_cli
from floorline import timing
from floorline.hardware import lookup
from floorline.measure import cell as cell_module
from floorline.measure import energy
from floorline.measure.ab import Plan, SessionResult, summarise_sessions
from floorline.measure.cell import measure_cell
from floorline.measure.energy import EnergyMeter
from floorline.measure.fingerprint import environment, fingerprint_key
from floorline.records import CellKey
from floorline.store import Store
from floorline.timing import StepPlan, run_plan


class FakeNVML:
    """The few NVML calls the meter makes. The energy counter (mJ) is what the fake GPU has
    spent: `joules_per_step` for each step run so far; clocks and temperature follow it."""
    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 0, 0

    class NVMLError(Exception):
        pass

    def __init__(self, joules_per_step=2.5, counter=True, watts=300.0):
        self.steps, self.joules_per_step = 0, joules_per_step
        self.counter, self.watts = counter, watts

    def step(self):
        self.steps += 1

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.counter:
            raise self.NVMLError("Not Supported")
        return 10_000_000 + round(self.steps * self.joules_per_step * 1e3)

    def nvmlDeviceGetPowerUsage(self, h):
        return round(self.watts * 1e3)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980 if self.steps < 100 else 1755

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 40 + self.steps // 100


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(energy, "time", clock)
    return clock


def test_joules_per_token_from_the_energy_counter(fake_time):
    nvml = FakeNVML(joules_per_step=2.5)

    def step():  # 4 ms and 2.5 J a step: 625 W
        nvml.step()
        fake_time.now += 0.004

    t = run_plan(step, "cpu", StepPlan(10, 200), EnergyMeter(nvml, None))
    e = t.energy
    assert e["method"] == "energy counter" and e["tokens"] == 200
    assert e["joules_per_token"] == pytest.approx(2.5)
    assert e["mean_watts"] == pytest.approx(2.5 / 0.004)
    assert e["power_limit_w"] == 700
    assert e["at_start"] == {"sm_clock_mhz": 1980, "temperature_c": 40}  # after 10 warm-up steps
    assert e["at_end"] == {"sm_clock_mhz": 1755, "temperature_c": 42}  # 210 steps run


def test_energy_over_auto_steps_counts_the_timed_batches_and_never_the_warm_up(fake_time):
    nvml = FakeNVML(joules_per_step=1.0)

    def step():
        nvml.step()
        fake_time.now += 0.002

    t = run_plan(step, "cpu", StepPlan(0, None, steps_cap=100), EnergyMeter(nvml, None))
    n = len(t.samples_ms)
    assert n < 100 and n * 0.002 < timing.ENERGY_MIN_S
    # the timed steps took under a second: more follow for energy, up to the steps' cap
    assert t.energy["tokens"] == 100 and t.energy["joules"] == pytest.approx(100 * 1.0)
    assert t.energy["seconds"] == pytest.approx(100 * 0.002)


def test_short_timings_are_metered_for_a_second_within_the_reserved_steps(fake_time):
    nvml = FakeNVML(joules_per_step=2.0)

    def step():  # 4 ms: 64 timed steps are 0.256 s
        nvml.step()
        fake_time.now += 0.004

    # auto warm-up settles after two windows, leaving most of its cap unused
    t = run_plan(step, "cpu", StepPlan(None, 64), EnergyMeter(nvml, None))
    assert t.warmup_steps == 2 * timing.WINDOW and len(t.samples_ms) == 64
    e = t.energy
    assert e["tokens"] == 250 and e["seconds"] == pytest.approx(1.0)  # ceil(0.744 / 0.004) more
    assert e["joules_per_token"] == pytest.approx(2.0)
    assert nvml.steps == 2 * timing.WINDOW + 250  # warm-up, timed and metered steps, no more
    # fixed counts reserve no room: the energy is read over the timed steps alone
    nvml.steps = 0
    t = run_plan(step, "cpu", StepPlan(8, 64), EnergyMeter(nvml, None))
    assert t.energy["tokens"] == 64 and nvml.steps == 72


def test_power_sampled_where_the_counter_is_missing(fake_time):
    nvml = FakeNVML(counter=False, watts=300.0)

    def step():
        nvml.step()
        fake_time.now += 0.004

    meter = EnergyMeter(nvml, None)
    t = run_plan(step, "cpu", StepPlan(0, 50), meter)
    assert t.energy["method"] == "power sampled"
    assert t.energy["mean_watts"] == pytest.approx(300.0)
    assert t.energy["joules_per_token"] == pytest.approx(300.0 * 0.004)


def test_a_counter_that_does_not_advance_gives_no_figure(fake_time):
    nvml = FakeNVML(joules_per_step=0.0)
    t = run_plan(lambda: fake_time.__setattr__("now", fake_time.now + 0.001), "cpu",
                 StepPlan(0, 8), EnergyMeter(nvml, None))
    assert t.energy is None


def test_the_cpu_is_not_metered():
    assert energy.open_meter("cpu") == (None, "not measured on the CPU")


def test_energy_columns_with_nvml_and_none_on_the_cpu(tmp_path, monkeypatch):
    gpu = lookup("l4")
    key = CellKey("tiny-llama", 16, "hf-eager", 12, 2)
    env = environment("cpu")
    cpu_db, nvml_db = tmp_path / "cpu.db", tmp_path / "nvml.db"
    Store(cpu_db).add(measure_cell(key, "cpu", gpu), env, fingerprint_key(env))

    # Each read of the fake counter advances it by 3 J: one timed batch reads it twice, so the
    # 12 timed steps spent 3 J, 0.25 J a token.
    nvml = FakeNVML()
    reads = iter(range(10**6))
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: 3000 * next(reads)
    monkeypatch.setattr(cell_module, "open_meter", lambda device: (EnergyMeter(nvml, None), None))
    measured = measure_cell(key, "cpu", gpu)
    assert measured.details["energy"]["joules_per_token"] == pytest.approx(3 / 12)
    Store(nvml_db).add(measured, env, fingerprint_key(env))

    shown = run_cli("show", "--db", nvml_db, check=True).stdout
    assert "J/token" in shown and "0.25" in shown and "(700)" in shown
    shown = run_cli("show", "--db", cpu_db, check=True).stdout
    assert "J/token" not in shown and "energy per token: not measured on the CPU" in shown
    row = json.loads(run_cli("show", "--db", cpu_db, "--json", check=True).stdout)[0]
    assert "energy" not in row["details"]
    assert row["details"]["energy_note"] == "not measured on the CPU"


def session(index, ms_a, ms_b, j_a=None, j_b=None):
    e = lambda j: None if j is None else {"joules_per_token": j}  # noqa: E731
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
        details = {"energy": {"joules_per_token": joules}} if joules else {
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
    assert "figure 7: No cell here has its energy per token" in "\n".join(written["missing"])


def test_readings_a_gpu_does_not_report_are_left_out(fake_time):
    nvml = FakeNVML()

    def unsupported(*args):
        raise FakeNVML.NVMLError("Not Supported")

    nvml.nvmlDeviceGetEnforcedPowerLimit = nvml.nvmlDeviceGetTemperature = unsupported

    def step():
        nvml.step()
        fake_time.now += 0.004

    e = run_plan(step, "cpu", StepPlan(0, 20), EnergyMeter(nvml, None)).energy
    assert e["joules_per_token"] == pytest.approx(2.5) and e["power_limit_w"] is None
    assert e["at_start"] == {"sm_clock_mhz": 1980, "temperature_c": None}
    from floorline.cli import energy_columns

    assert energy_columns(e) == ["2.5", "625 (-)", "1980-1980", "-"]
