"""Steady state before timing and `--steps auto`, on synthetic steps whose durations a fake
clock sets, so that every count below follows from arithmetic."""

import json
import math

import numpy as np
import pytest
from scipy.stats import binom

from conftest import run_here
from floorline import timing
from floorline.measure.steadiness import unsteady_reason
from floorline.stats import _bootstrap, block_median_interval
from floorline.timing import StepPlan, drift, drift_noise, run_plan


class FakeClock:
    """perf_counter for the timer: each call of step() advances it by the next duration."""

    def __init__(self, duration_ms):
        self.now, self.k, self.duration_ms = 0.0, 0, duration_ms

    def perf_counter(self):
        return self.now

    def step(self):
        self.now += self.duration_ms(self.k) / 1e3
        self.k += 1


@pytest.fixture
def clock(monkeypatch):
    def make(duration_ms):
        c = FakeClock(duration_ms)
        monkeypatch.setattr(timing, "time", c)
        return c
    return make


def test_a_slow_start_is_warmed_through(clock):
    # 1 ms steps, the first ones slower by e^(-k/20): the excess is under the 1% tolerance
    # from step 93 (20 ln 100 = 92.1) on, and windows compared by their medians see it within
    # three windows of that.
    c = clock(lambda k: 1.0 + math.exp(-k / 20))
    t = run_plan(c.step, "cpu", StepPlan(None, 64))
    assert t.steady and 93 <= t.warmup_steps <= 93 + 3 * timing.WINDOW
    assert t.drift == pytest.approx(1.0, abs=0.005)
    # The same 64 steps without warm-up drift by the slow start: the medians of steps 48-63
    # and 0-15 are the means of steps 55 and 56, and of 7 and 8.
    c2 = clock(lambda k: 1.0 + math.exp(-k / 20))
    cold = run_plan(c2.step, "cpu", StepPlan(0, 64))
    expected = ((1 + (math.exp(-55 / 20) + math.exp(-56 / 20)) / 2)
                / (1 + (math.exp(-7 / 20) + math.exp(-8 / 20)) / 2))
    assert cold.warmup_steps == 0 and cold.drift == pytest.approx(expected)


def test_a_plateau_of_slow_steps_is_warmed_through(clock):
    # 11% slower for the first 30 steps, then steady: the first window's median is slow, the
    # second is not, the third agrees with the second.
    c = clock(lambda k: 1.11 if k < 30 else 1.0)
    t = run_plan(c.step, "cpu", StepPlan(None, 64))
    assert t.steady and t.warmup_steps == 3 * timing.WINDOW
    assert t.samples_ms == pytest.approx([1.0] * 64) and t.drift == pytest.approx(1.0)


def test_a_steady_step_stops_after_two_windows(clock):
    c = clock(lambda k: 2.0 + 0.001 * (k % 3))
    t = run_plan(c.step, "cpu", StepPlan(None, 16))
    assert t.steady and t.warmup_steps == 2 * timing.WINDOW < timing.WARMUP_CAP
    assert c.k == 2 * timing.WINDOW + 16


def test_a_step_that_never_settles_stops_at_the_cap(clock):
    c = clock(lambda k: 1.0 * 1.05 ** (k // timing.WINDOW))  # 5% slower every window
    t = run_plan(c.step, "cpu", StepPlan(None, 8, warmup_cap=160))  # 160 steps: under 1 s
    assert t.steady is False and t.warmup_steps == 160
    assert t.details()["steady"] is False


def test_a_slow_unsettled_step_stops_at_the_time_cap(clock):
    # 48 ms steps growing 5% every 11 steps (a CPU window: the steps that fill 0.5 s): no two
    # windows within their noise, and the window that passes 5 s of steps is the last, long
    # before the cap of 512 steps.
    duration = lambda k: 48.0 * 1.05 ** (k / 11)  # noqa: E731
    c = clock(duration)
    t = run_plan(c.step, "cpu", StepPlan(None, 4))
    spent = sum(duration(k) for k in range(t.warmup_steps))
    assert t.steady is False and t.warmup_steps < timing.WARMUP_CAP
    assert timing.WARMUP_MAX_S * 1e3 <= spent < timing.WARMUP_MAX_S * 1e3 + timing.WINDOW * 60
    assert t.details()["warmup_window_s"] == timing.CPU_WINDOW_S


def test_on_the_cpu_windows_agree_within_their_own_noise(clock):
    """40 ms steps with 8% noise and no trend: their windows' medians differ by more than 1%
    but within the noise, so the step is steady after a few windows, the tolerance recorded."""
    noise = np.random.default_rng(3).normal(0, 0.08, 1000)
    c = clock(lambda k: 40.0 * (1 + noise[k]))
    t = run_plan(c.step, "cpu", StepPlan(None, 16))
    assert t.steady and t.warmup_steps <= 4 * 13
    assert timing.TOLERANCE < t.tolerance <= timing.MAX_TOLERANCE
    assert t.details()["warmup_tolerance"] == pytest.approx(t.tolerance, abs=1e-5)
    windows = [list(40.0 * (1 + noise[i:i + 13])) for i in (0, 13)]
    assert timing.agreement_tolerance(*windows) > timing.TOLERANCE


def test_on_the_cpu_a_trend_larger_than_the_noise_is_not_steady(clock):
    # 1% noise, 5% slower every 13 steps (0.5 s of 40 ms): never within the noise
    noise = np.random.default_rng(4).normal(0, 0.01, 1000)
    c = clock(lambda k: 40.0 * 1.05 ** (k / 13) * (1 + noise[k]))
    t = run_plan(c.step, "cpu", StepPlan(None, 4))
    assert t.steady is False and t.tolerance < 0.05

@pytest.fixture
def gpu_steps(monkeypatch):
    """Steps "on a GPU" whose event-timed durations are the given function of the step's index
    (timing.timed_batch replaced: the rule, not the events, is under test)."""
    def make(duration_ms):
        count = iter(range(10**6))
        monkeypatch.setattr(timing, "timed_batch", lambda step, device, steps, meter=None:
                            [duration_ms(next(count)) for _ in range(steps)])
    return make


def test_a_gpu_step_launched_from_python_is_steady_within_its_noise(gpu_steps):
    """A 7B eager step as on a shared H100: 67 ms with 10% noise and no trend. Held to 1%, no
    two windows of 32 agreed; within their own noise they do, and the tolerance is recorded."""
    noise = np.random.default_rng(5).normal(0, 0.10, 4000)
    gpu_steps(lambda k: 67.0 * (1 + noise[k]))
    t = run_plan(None, "cuda", StepPlan(None, 64))
    assert t.steady and timing.TOLERANCE < t.tolerance <= timing.MAX_TOLERANCE
    assert t.details()["warmup_tolerance"] == pytest.approx(t.tolerance, abs=1e-5)
    assert "warmup_window_s" not in t.details()  # a GPU's windows are counted in steps


def test_a_gpu_step_run_back_to_back_is_held_to_one_percent(gpu_steps):
    """The engine's step (5 ms, 0.3% noise): its windows' noise is far under 1%, so 1% it is,
    and a 2% change between windows is a trend, not noise."""
    noise = np.random.default_rng(6).normal(0, 0.003, 4000)
    windows = [list(5.0 * (1 + noise[i:i + timing.WINDOW])) for i in (0, timing.WINDOW)]
    assert timing.agreement_tolerance(*windows) == timing.TOLERANCE
    gpu_steps(lambda k: 5.0 * 1.02 ** (k // timing.WINDOW) * (1 + noise[k]))
    t = run_plan(None, "cuda", StepPlan(None, 8, warmup_cap=256))
    assert t.steady is False and t.warmup_steps == 256


def test_a_gpu_window_cut_short_by_the_cap_is_not_compared(gpu_steps):
    """A cap of 65 steps leaves a last window of one step: it has no quartiles, and the warm-up
    ends at the cap, unsteady (5% slower a window), instead of failing."""
    gpu_steps(lambda k: 5.0 * 1.05 ** (k // timing.WINDOW))
    t = run_plan(None, "cuda", StepPlan(None, 8, warmup_cap=2 * timing.WINDOW + 1))
    assert t.steady is False and t.warmup_steps == 2 * timing.WINDOW + 1


def test_a_slow_gpu_step_gets_several_windows_before_the_time_cap(gpu_steps):
    """90 ms steps: two windows of 32 pass the 5 s cap, yet the warm-up compares MIN_WINDOWS of
    them before it stops; a trend of 6% a window, beyond the largest tolerance, is unsteady."""
    noise = np.random.default_rng(7).normal(0, 0.02, 4000)
    gpu_steps(lambda k: 90.0 * 1.06 ** (k // timing.WINDOW) * (1 + noise[k]))
    t = run_plan(None, "cuda", StepPlan(None, 8))
    assert t.steady is False
    assert t.warmup_steps == timing.MIN_WINDOWS * timing.WINDOW
    assert 2 * timing.WINDOW * 90.0 > timing.WARMUP_MAX_S * 1e3


def test_a_fixed_warmup_runs_exactly_that_many(clock):
    c = clock(lambda k: 1.0)
    t = run_plan(c.step, "cpu", StepPlan(5, 7))
    assert (t.warmup_steps, len(t.samples_ms), c.k, t.steady) == (5, 7, 12, None)


def order_statistic_width(x) -> float:
    """The distribution-free 95% interval of the median (binomial ranks), relative width."""
    x, n = np.sort(x), len(x)
    j = int(binom.ppf(0.025, n, 0.5))  # ranks j+1 .. n-j hold the median with >= 95%
    return (x[n - j - 1] - x[j]) / np.median(x)


@pytest.mark.parametrize("rel_width", [0.01, 0.004])
def test_steps_auto_stops_at_the_width_asked(clock, rel_width):
    noise = np.random.default_rng(7).normal(0, 0.02, 10_000)
    c = clock(lambda k: 1.0 + noise[k])
    t = run_plan(c.step, "cpu", StepPlan(0, None, rel_width))
    n = len(t.samples_ms)
    assert t.width_reached and n < timing.STEPS_CAP
    low, high = t.median_ci_ms
    assert (high - low) / np.median(t.samples_ms) <= rel_width
    # Independently: the order-statistic interval is about as wide as asked (a batch adds a
    # quarter more steps, narrowing it by about a tenth; the rest is the sample's own luck).
    assert 0.6 * rel_width <= order_statistic_width(t.samples_ms) <= 1.1 * rel_width
    # The rule was checked after every batch: a batch before the stop it was still too wide.
    sizes = [timing.FIRST_STEPS]
    while sizes[-1] < n:
        sizes.append(sizes[-1] + max(timing.FIRST_STEPS // 2, sizes[-1] // 4))
    assert sizes[-1] == n
    iv = block_median_interval(t.samples_ms[:sizes[-2]])
    assert iv.high - iv.low > rel_width * iv.estimate
    # Normal noise of sd 2%: the median's interval is 2 x 1.96 x 1.2533 x 0.02 / sqrt(n) wide.
    expected_n = (2 * 1.96 * 1.2533 * 0.02 / rel_width) ** 2
    assert 0.4 * expected_n <= n <= 1.7 * expected_n


def test_steps_auto_stops_at_its_cap(clock):
    noise = np.random.default_rng(3).normal(0, 0.05, 1000)
    c = clock(lambda k: 1.0 + noise[k])
    t = run_plan(c.step, "cpu", StepPlan(0, None, 0.001, steps_cap=200))
    assert len(t.samples_ms) == 200 and t.width_reached is False


def test_a_width_not_reached_is_an_unsteady_cell_saying_so(tmp_path):
    # At ctx 3948 tiny-mistral-swa's 4096 positions leave room for 148 steps of a session that
    # cannot rewind (transformers' sliding-window layers): the cap, reached long before an
    # interval 1e-9 of the median.
    db = tmp_path / "r.db"
    proc = run_here("sweep", "--db", db, "--models", "tiny-mistral-swa", "--ctx", "3948",
                   "--paths", "hf-eager", "--steps", "auto", "--rel-width", "1e-9", "--warmup",
                   "0", "--device", "cpu", "--gpu", "l4", check=True)
    # found unsteady, and so measured once more after the others: unsteady again
    assert proc.stderr.count("unsteady: tiny-mistral-swa ctx=3948 hf-eager: --steps auto "
                             "stopped") == 2
    assert "measuring the 1 unsteady cell(s) once more, after the others" in proc.stderr
    [cell] = json.loads(run_here("show", "--db", db, "--json", check=True).stdout)
    assert cell["details"]["measured_again"].startswith(
        "after an unsteady attempt: --steps auto stopped at its cap of 148 timed steps")
    low, high = cell["details"]["median_ci_ms"]
    assert cell["status"] == "unsteady" and cell["details"]["width_reached"] is False
    assert cell["reason"].startswith(
        f"--steps auto stopped at its cap of 148 timed steps with the median's 95% interval at "
        f"{low:.3g}-{high:.3g} ms, {(high - low) / cell['median_ms']:.3g} of the median "
        f"{cell['median_ms']:.3g} ms, wider than the --rel-width 1e-09 asked")
    assert "or with a wider --rel-width" in cell["reason"]
    assert "unsteady" in run_here("show", "--db", db, check=True).stdout


def test_why_a_cell_whose_width_was_not_reached_is_not_valid():
    details = {"width_reached": False, "median_ci_ms": [6.0, 9.8], "timed_steps": 2032,
               "steps_rule": {"rel_width": 1e-9, "cap": 2032}, "drift": 1.0}
    summary = {"n": 2032, "median_ms": 7.6, "p10_ms": 7.0, "p90_ms": 8.0}
    assert unsteady_reason(details, summary) == (
        "--steps auto stopped at its cap of 2032 timed steps with the median's 95% interval at "
        "6-9.8 ms, 0.5 of the median 7.6 ms, wider than the --rel-width 1e-09 asked. Measure it "
        "again on an idle host: the next `floorline sweep` measures it again (`--force` would "
        "re-measure the valid cells too), or with a wider --rel-width.")
    drifted = unsteady_reason({**details, "drift": 2.0}, summary)
    assert "asked; its last quarter of timed steps took 2x" in drifted
    assert drifted.count("Measure it again") == 1
    assert drifted.endswith("valid cells too), or with a wider --rel-width.")
    assert unsteady_reason({**details, "width_reached": True}, summary) is None


def test_steps_auto_on_identical_steps_stops_at_the_first_batch(clock):
    c = clock(lambda k: 3.0)
    t = run_plan(c.step, "cpu", StepPlan(0, None))
    assert len(t.samples_ms) == timing.FIRST_STEPS and t.median_ci_ms == pytest.approx((3.0, 3.0))


def test_drift_is_last_quarter_over_first():
    assert drift([1.0] * 4 + [5.0] * 8 + [1.1] * 4) == pytest.approx(1.1)
    assert drift([1.0, 2.0, 3.0]) is None


def test_drift_noise_is_twice_the_error_of_the_quarters_medians_ratio():
    # Independent steps of sd 2%: each quarter's median has a standard error of
    # 1.2533 x 0.02 / sqrt(q), so the ratio's noise is 2 x sqrt(2) times that.
    steps = list(np.random.default_rng(11).normal(1, 0.02, 1024))
    expected = 2 * math.sqrt(2) * 1.2533 * 0.02 / math.sqrt(256)
    assert 0.7 * expected < drift_noise(steps) < 1.4 * expected
    # A host slow for 16 steps at a time, then fast: the quarters' medians stray further, and
    # the noise says so.
    swings = np.repeat(np.random.default_rng(12).normal(1, 0.1, 64), 16)
    swinging = list(swings + np.random.default_rng(13).normal(0, 0.02, 1024))
    assert drift_noise(swinging) > 3 * expected
    assert drift_noise([1.0] * 15) is None  # quarters of 3 steps: too few
    assert drift_noise([2.0] * 16) == 0


def single_step_interval(steps, seed: int = 0) -> tuple[float, float]:
    """The median's percentile bootstrap interval resampling single steps, as if independent."""
    return _bootstrap(np.asarray(steps), np.median, "percentile", seed, 0.95, 2_000)


def test_the_median_interval_widens_with_a_hosts_slow_swings():
    # A host slow for 8 steps at a time, then fast: neighbours are not independent. Over 100
    # such series the block bootstrap's 95% interval holds the true median (1) most times;
    # resampling single steps, as if independent, about half the time.
    held_block = held_single = 0
    for k in range(100):
        rng = np.random.default_rng(k)
        steps = np.repeat(rng.normal(1, 0.1, 32), 8) + rng.normal(0, 0.02, 256)
        block, (low, high) = block_median_interval(steps, seed=k), single_step_interval(steps, k)
        assert block.estimate == np.median(steps)
        held_block += block.low <= 1 <= block.high
        held_single += low <= 1 <= high
    assert held_block >= 75 and held_single <= 65
    # Independent steps: the two intervals about as wide.
    steps = np.random.default_rng(5).normal(1, 0.02, 512)
    block, (low, high) = block_median_interval(steps), single_step_interval(steps)
    assert 0.7 < (block.high - block.low) / (high - low) < 1.4
    same = block_median_interval([3.0] * 10)
    assert (same.estimate, same.low, same.high, same.n) == (3.0, 3.0, 3.0, 10)


def test_plan_caps_shrink_to_the_positions_left():
    plan = StepPlan(None, None).within(1000)
    assert plan.most_warmup + plan.most_steps <= 1000
    assert plan.warmup_cap == int(512 * 1000 / (512 + 2048))
    plan = StepPlan(100, None).within(600)
    assert (plan.most_warmup, plan.most_steps) == (100, 500)
    assert StepPlan(None, 16).within(0).warmup_cap == 2 * timing.WINDOW
    assert StepPlan(8, 64).within(10) == StepPlan(8, 64)  # fixed counts are never cut


@pytest.mark.parametrize("args, message", [
    (("--warmup", "soon"), "--warmup must be 'auto' or a whole number of steps, got 'soon'"),
    (("--warmup", "-1"), "--warmup must be 'auto' or from 0 to"),
    (("--steps", "0"), "--steps must be 'auto' or from 1 to"),
    (("--steps", "many"), "--steps must be 'auto' or a whole number of steps, got 'many'"),
    (("--steps", "auto", "--rel-width", "0"), "--rel-width must be above 0 and below 1"),
    (("--steps", "auto", "--rel-width", "1.5"), "--rel-width must be above 0 and below 1"),
    (("--steps", "auto", "--rel-width", "nan"), "--rel-width must be above 0 and below 1"),
    (("--steps", "64", "--rel-width", "0.01"), "--rel-width applies only with --steps auto"),
    # the cell's key keeps 6 digits: this would be measured, and skipped, as 0.5
    (("--steps", "auto", "--rel-width", "0.5000001"),
     "--rel-width takes at most 6 significant digits, got 0.5000001"),
])
def test_bad_step_options_are_one_line(tmp_path, args, message):
    proc = run_here("sweep", "--db", tmp_path / "r.db", "--models", "tiny-llama", "--ctx", "16",
                    "--gpu", "l4", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "r.db").exists()


@pytest.mark.parametrize("command", [
    ("ab", "--a", "hf-eager", "--b", "hf-static"),
    ("explain", "--path", "hf-eager"),
])
def test_bad_warmup_of_ab_and_explain_is_one_line(tmp_path, command):
    proc = run_here(*command, "--model", "tiny-llama", "--ctx", "16", "--warmup", "x",
                    "--db", tmp_path / "r.db", "--gpu", "l4")
    assert proc.returncode == 2 and "--warmup must be 'auto'" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
