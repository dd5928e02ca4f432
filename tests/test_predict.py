"""The forecast against arithmetic on cells whose terms are known, and the errors a user sees."""

import json
import statistics
from pathlib import Path

import pytest

import floorline
from conftest import run_cli
from floorline.errors import FloorlineError
from floorline.forecast.accuracy import (
    SMALL,
    by_family,
    coverage,
    forecast,
    interval,
    interval_bounds,
    leave_one_gpu_out,
    leave_one_out,
)
from floorline.forecast.calibration import Calibration, combine, from_rows, shipped
from floorline.forecast.model import fit, step
from floorline.forecast.published import published_cells
from floorline.forecast.terms import attention_bytes, layers, weight_bytes
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.store import CellRow
from floorline.traffic import floor

PEAK = {g: lookup(g).peak_gbps * 1e6 for g in ("h200", "l4", "h100-sxm5")}  # bytes per ms
GRAPH_US = 0.9
STREAM = 4000 / 4800  # the probe's streaming read on the H200, a fraction of its peak


def cell(path, model, ctx, ms, gpu="h200", fmt="bf16", kv="bf16"):
    return {"model": model, "ctx": ctx, "path": path, "gpu": gpu, "ms": ms, "weight_format": fmt,
            "kv_dtype": kv, "source": f"test {path} {ctx}"}


def synthetic(model, ctx, path="engine", fmt="bf16", gpu="h200", stream=STREAM, eta_a=0.5,
              tau_us=10.0, sm_ms_per_gb=0.0):
    """A step that is exactly its weights streamed at `stream` of peak, `sm_ms_per_gb` a GB of
    them, `tau_us` a layer and attention at `eta_a` of peak."""
    w = weight_bytes(model, fmt)
    return (w / (stream * PEAK[gpu]) + w / 1e9 * sm_ms_per_gb + layers(model) * tau_us / 1e3
            + attention_bytes(model, ctx, path, "bf16") / (eta_a * PEAK[gpu]))


SRC = {"PYTHONPATH": str(Path(floorline.__file__).parents[1])}  # this checkout, from any cwd
PROBE = {"gpu": "h200", "eager_us": 7.0, "graph_us": GRAPH_US, "stream_read_gbps": 4000,
         "source": "probe"}


def test_gpu_governed_terms_recovered_and_carried_to_another_gpu():
    # Engine cells built from known terms (weights at the probe's 4000 of 4800 GB/s, 10 us a
    # layer, attention at half of peak): the fit recovers them, and an L4 forecast is the same
    # bytes over the L4's peak at those fractions plus the same 10 us a layer.
    cells = [cell("engine", m, c, synthetic(m, c))
             for m in ("qwen2.5-7b", "llama-3.1-8b") for c in (2048, 16384)]
    cal = Calibration(cells, [], [PROBE])
    f = fit(cal, "engine", "l4", "qwen2.5-7b")
    assert f.terms["attention's fraction of peak"].value == pytest.approx(0.5)
    assert f.terms["memory's streaming read"].value == pytest.approx(STREAM)
    assert f.terms["fixed cost per layer"].value == pytest.approx(10.0)
    assert "SM time per weight GB" not in f.terms  # the 16-bit path is its own reference
    s = step(f, "qwen2.5-7b", 8192)
    expected = (weight_bytes("qwen2.5-7b", "bf16") / (STREAM * PEAK["l4"]) + 28 * 10e-3
                + attention_bytes("qwen2.5-7b", 8192, "engine", "bf16") / (0.5 * PEAK["l4"]))
    assert s.gpu_ms == pytest.approx(expected) and s.host_ms == pytest.approx(GRAPH_US / 1e3)
    assert s.ms == pytest.approx(expected)
    loo = leave_one_out(cal)
    assert len(loo) == 4 and max(abs(r["error"]) for r in loo) < 1e-9


def test_a_quantised_path_adds_sm_time_per_gb_to_its_familys_fixed_cost():
    # engine gives 10 us a layer; engine-int4's cells take 0.2 ms more per GB of its weights
    # beyond that. On a GPU of other bandwidth the streamed part scales, the rest does not.
    cells = [cell("engine", m, c, synthetic(m, c))
             for m in ("qwen2.5-7b", "llama-3.1-8b") for c in (2048, 16384)]
    cells += [cell("engine-int4", m, 2048, synthetic(m, 2048, "engine-int4", "engine-int4",
                                                     sm_ms_per_gb=0.2), fmt="engine-int4")
              for m in ("qwen2.5-7b", "llama-3.1-8b")]
    f = fit(Calibration(cells, [], [PROBE]), "engine-int4", "h100-sxm5",
            "llama-3.1-8b")
    assert f.terms["fixed cost per layer"].value == pytest.approx(10.0)
    assert f.terms["SM time per weight GB"].value == pytest.approx(0.2)
    w = weight_bytes("llama-3.1-8b", "engine-int4")
    expected = (w / (STREAM * PEAK["h100-sxm5"]) + w / 1e9 * 0.2 + 32 * 10e-3
                + attention_bytes("llama-3.1-8b", 4096, "engine", "bf16")
                / (0.5 * PEAK["h100-sxm5"]))
    assert step(f, "llama-3.1-8b", 4096).gpu_ms == pytest.approx(expected)


def test_the_fixed_cost_per_layer_is_the_models_architectures():
    # Llama's layers take 20 us beyond their bytes, Qwen2's 10 (other kernels a layer). A Llama
    # model of another size (Llama-3.2-1B) takes Llama's; Qwen3, of neither, the median of all. The
    # int4 path's SM time per GB comes out exact with each cell's own architecture's cost.
    tau = {"llama-3.1-8b": 20.0, "qwen2.5-7b": 10.0}
    cells = [cell("engine", m, c, synthetic(m, c, tau_us=tau[m])) for m in tau
             for c in (2048, 16384)]
    cells += [cell("engine-int4", m, 2048, synthetic(m, 2048, "engine-int4", "engine-int4",
                                                     tau_us=tau[m], sm_ms_per_gb=0.2),
                   fmt="engine-int4") for m in tau]
    cal = Calibration(cells, [], [PROBE])
    assert fit(cal, "engine", "h200", "llama-3.2-1b").terms[
        "fixed cost per layer"].value == pytest.approx(20.0)
    assert "of llama models" in fit(cal, "engine", "h200", "llama-3.2-1b").terms[
        "fixed cost per layer"].source
    assert fit(cal, "engine", "h200", "qwen3-8b").terms[
        "fixed cost per layer"].value == pytest.approx(15.0)
    int4 = fit(cal, "engine-int4", "h100-sxm5", "llama-3.1-8b")
    assert int4.terms["SM time per weight GB"].value == pytest.approx(0.2)
    assert max(abs(r["error"]) for r in leave_one_out(cal)) < 1e-9


def test_without_a_probe_the_forecast_asks_for_one():
    cells = [cell("engine", "qwen2.5-7b", c, 5.0 + c / 1e5) for c in (2048, 16384)]
    with pytest.raises(FloorlineError, match="streaming read is missing.*floorline probe"):
        fit(Calibration(cells, [], []), "engine", "h200", "qwen2.5-7b")


def test_small_kernels_from_explain_are_per_layer_and_per_kernel():
    # explain: 56 small kernels on 28 layers (2 a layer) at 0.112 ms = 2 us each. Llama has 32
    # layers, so 64 small kernels = 0.128 ms ride on its step.
    expl = {"path": "engine", "model": "qwen2.5-7b", "ctx": 2048, "gpu": "h200",
            "kernels_per_step": 200, "source": "explain",
            "classes": {"matrix-vector": {"kernels_per_step": 113, "ms": 3.0},
                        "attention": {"kernels_per_step": 31, "ms": 0.3},
                        "elementwise": {"kernels_per_step": 56, "ms": 0.112}}}
    small = lambda m: 2 * layers(m) * 2e-3  # noqa: E731
    cells = [cell("engine", m, c, synthetic(m, c) + small(m))
             for m in ("qwen2.5-7b", "llama-3.1-8b") for c in (2048, 16384)]
    f = fit(Calibration(cells, [expl], [PROBE]), "engine", "h200", "llama-3.1-8b")
    assert f.terms["small kernels per layer"].value == pytest.approx(2.0)
    assert f.terms["cost per small kernel"].value == pytest.approx(2.0)
    assert f.terms["fixed cost per layer"].value == pytest.approx(10.0)
    assert step(f, "llama-3.1-8b", 4096).parts["small kernels"] == pytest.approx(0.128)


EAGER_EXPLAIN = {"path": "hf-eager", "model": "qwen2.5-7b", "ctx": 2048, "gpu": "h200",
                 "kernels_per_step": 1400, "source": "explain",
                 "classes": {"matrix-vector": {"kernels_per_step": 338, "ms": 4.5},
                             "attention": {"kernels_per_step": 28, "ms": 0.2},
                             "elementwise": {"kernels_per_step": 1034, "ms": 1.0}}}


def eager_calibration(probes):
    # the graphed twin's cells: 10 us a layer, attention at 0.2 of peak and explain's 1034 small
    # kernels (1.0 ms on Qwen's 28 layers)
    graphs = [cell("hf-static+graphs", "qwen2.5-7b", c,
                   synthetic("qwen2.5-7b", c, "hf-static", eta_a=0.2) + 1.0)
              for c in (2048, 16384)]
    return Calibration([cell("hf-eager", "qwen2.5-7b", c, 56.0) for c in (2048, 8192)] + graphs,
                       [EAGER_EXPLAIN], probes)


def test_host_bound_path_is_launches_times_host_cost():
    # 1400 launches a step on Qwen's 28 layers (50 a layer) at 40 us = 56 ms; Llama's 32 layers
    # then launch 1600, 64 ms, far above its GPU side on the same host.
    f = fit(eager_calibration([PROBE]), "hf-eager", "h200", "qwen2.5-7b")
    assert f.kind == "host-bound"
    assert f.terms["launches per layer"].value == pytest.approx(50.0)
    assert f.terms["host cost per launch"].value == pytest.approx(40.0)
    s = step(f, "llama-3.1-8b", 2048)
    assert s.host_ms == pytest.approx(64.0) and s.ms == pytest.approx(64.0) and s.gpu_ms < s.host_ms


def test_a_host_bound_step_on_an_unmeasured_host_is_not_forecast():
    # The host is the machine's: no cell of hf-eager and no probe with the H100, so no number,
    # only the GPU side's forecast (weights streamed, 10 us a layer, attention, 1.0 ms of small
    # kernels), and the command that measures the host. Attention at 0.2 of peak is not bound
    # by the memory: its time is the H200's.
    f = fit(eager_calibration([PROBE]), "hf-eager", "h100-sxm5", "qwen2.5-7b")
    gpu_side = (weight_bytes("qwen2.5-7b", "bf16") / (STREAM * PEAK["h100-sxm5"]) + 28 * 10e-3
                + attention_bytes("qwen2.5-7b", 2048, "hf-eager", "bf16")
                / (0.2 * PEAK["h200"]) + 1.0)
    with pytest.raises(FloorlineError) as e:
        step(f, "qwen2.5-7b", 2048)
    message = str(e.value)
    assert "no host was measured with the h100-sxm5" in message
    assert "40.0 us a launch there" in message
    assert f"GPU side is forecast at {gpu_side:.2f} ms" in message
    assert "`floorline probe --db floorline.db`" in message and "\n" not in message
    # With a probe of that host, whose bare launch costs half the H200 host's, the host cost
    # per launch is the cells' scaled by the same half: 20 us, 28 ms a step.
    probed = eager_calibration([PROBE, {**PROBE, "gpu": "h100-sxm5", "eager_us": 3.5}])
    f = fit(probed, "hf-eager", "h100-sxm5", "qwen2.5-7b")
    assert f.terms["host cost per launch"].value == pytest.approx(20.0)
    assert step(f, "qwen2.5-7b", 2048).host_ms == pytest.approx(28.0)


def host_layer_probe(gpu, arch, layer_us=600.0, step_us=400.0):
    """A probe whose host ran hf-eager's layer of `arch` at `layer_us`, the rest at `step_us`."""
    return {**PROBE, "gpu": gpu, "host_layers": [{
        "path": "hf-eager", "layer_us": layer_us, "step_us": step_us, "architecture": arch,
        "rounds_us": [[layer_us, step_us]] * 5}]}


def test_a_probe_of_the_host_running_the_models_layer_gives_its_host_side():
    # The H100's host ran a Qwen2 layer in 600 us and the rest of a step in 400 us: Qwen2.5-7B's
    # 28 layers take 28 x 0.6 + 0.4 = 17.2 ms there, whatever the H200's cells of hf-eager say
    # (56 ms: their host's). A probe of the H200's host that ran it, and two H100 probes at
    # 500 and 700 us, give the H100's median, 600 us.
    probes = [PROBE, host_layer_probe("h200", "qwen2", 2000.0),
              host_layer_probe("h100-sxm5", "qwen2", 500.0),
              host_layer_probe("h100-sxm5", "qwen2", 700.0)]
    f = fit(eager_calibration(probes), "hf-eager", "h100-sxm5", "qwen2.5-7b")
    assert f.terms["host time per layer"].value == pytest.approx(600.0)
    assert "2 probes of h100-sxm5's host" in f.terms["host time per layer"].source
    assert "host cost per launch" not in f.terms
    assert step(f, "qwen2.5-7b", 2048).host_ms == pytest.approx(28 * 0.6 + 0.4)
    # Llama's layer is not the probe's: its host side comes from the cells, scaled by the bare
    # launches (both 7.0 us here), as without the probe.
    f = fit(eager_calibration(probes), "hf-eager", "h100-sxm5", "llama-3.1-8b")
    assert "host time per layer" not in f.terms
    assert f.terms["host cost per launch"].value == pytest.approx(40.0)


@pytest.mark.parametrize("eta_a, carried", [(0.5, "fraction"), (0.2, "time")])
def test_attention_far_below_the_memory_carries_its_time_not_its_fraction(eta_a, carried):
    # Cells whose attention reads at eta_a of the H200's peak, forecast on the H100 (1.43x less
    # bandwidth): at half of peak the attention is the memory's, and takes 1.43x the time there;
    # at a fifth (a third or less) it is not, and takes the H200's time per GB.
    cells = [cell("engine", "qwen2.5-7b", c, synthetic("qwen2.5-7b", c, eta_a=eta_a))
             for c in (2048, 16384)]
    f = fit(Calibration(cells, [], [PROBE]), "engine", "h100-sxm5", "qwen2.5-7b")
    nbytes = attention_bytes("qwen2.5-7b", 8192, "engine", "bf16")
    h200_ms = nbytes / (eta_a * PEAK["h200"])
    attention = step(f, "qwen2.5-7b", 8192).parts["attention"]
    if carried == "fraction":
        assert f.terms["attention's fraction of peak"].value == pytest.approx(eta_a)
        assert attention == pytest.approx(h200_ms * PEAK["h200"] / PEAK["h100-sxm5"])
    else:
        term = f.terms["attention's time per GB"]
        assert term.value == pytest.approx(1e9 / (eta_a * PEAK["h200"]))
        assert "at 20% of peak: not bound by the memory" in term.source
        assert attention == pytest.approx(h200_ms)


def test_transformers_attention_counts_query_heads():
    # Qwen2.5-7B: 28 layers, 28 query heads of 128, bf16: K and V repeated to every head.
    expected = 28 * 2 * 28 * 128 * 2 * 1000
    assert attention_bytes("qwen2.5-7b", 1000, "hf-static+graphs", "bf16") == expected
    # The engine reads the cache as stored: 4 kv heads, and the new token's K and V.
    assert attention_bytes("qwen2.5-7b", 1000, "engine", "bf16") == 28 * 2 * 4 * 128 * 2 * 1001


def test_interval_is_conformal_order_statistics():
    errors = [i / 100 for i in range(-9, 10)]  # 19 errors: ranks 1 and 19 for 90%
    assert interval_bounds(errors) == (-0.09, 0.09)
    assert interval_bounds(errors[:18]) is None  # 18 are too few
    low, high = interval(10.0, errors)
    assert (low, high) == (pytest.approx(10 / 1.09), pytest.approx(10 / 0.91))
    rows = [{"kind": "k", "error": e, "forecast_ms": 1 + e, "measured_ms": 1.0}
            for e in errors + [0.5]]
    c = coverage(rows)["k"]
    # 0.5 lies outside the others' range; every other error lies within its others' range
    # except the extremes -0.09 (the others' lowest is -0.08) and 0.09 is inside (0.5 is there).
    assert (c["cells"], c["with_interval"], c["covered"]) == (20, 20, 18)


def test_shipped_calibration_meets_its_target_and_forecasts_every_engine_path():
    cal = shipped()
    loo = leave_one_out(cal)
    result = coverage(loo)
    assert result["GPU-governed"]["mae"] <= 0.10
    host = result["host-bound"]
    assert host["covered"] / host["with_interval"] >= 0.9
    for path in ("engine", "engine-int4", "engine-fp8", "engine-int4-fp8head", "llamacpp-q4_0"):
        f = forecast(cal, "llama-3.1-8b", "l4", 4096, path, loo)
        assert f.low < f.ms < f.high and "h200" in f.notes()[-1]


def test_cpu_cells_never_forecast_a_gpu():
    rows = [CellRow(id=1, status="valid", gpu="cpu", path="hf-eager", model="qwen2.5-7b",
                    ctx=128, steps=8, warmup=2, median_ms=150.0, weight_format="bf16",
                    kv_dtype="bf16", fingerprint_key="env", finished_at="x")]
    cal = from_rows(rows, [], {}, "db")
    assert cal.cells == [] and cal.cpu_paths == {"hf-eager"}
    with pytest.raises(FloorlineError,
                       match="hf-eager was measured only on the CPU.*missing: a cell"):
        fit(cal, "hf-eager", "h200", "qwen2.5-7b")


def test_predict_cli_runs_without_a_database_and_prints_its_terms(tmp_path):
    proc = run_cli("predict", "--model", "qwen2.5-7b", "--gpu", "L4", "--path", "engine",
                   cwd=tmp_path, check=True, env=SRC)
    assert "engine on l4, qwen2.5-7b ctx 2048:" in proc.stdout and "90% interval" in proc.stdout
    assert "memory's streaming read" in proc.stdout and "H200" in proc.stdout


def test_predict_cli_refusals(tmp_path):
    proc = run_cli("predict", "--model", "qwen2.5-7b", "--gpu", "l4", "--path", "hf-eager",
                   "--db", tmp_path / "none.db", cwd=tmp_path, env=SRC)
    assert proc.returncode == 2 and "no results database" in proc.stderr
    proc = run_cli("predict", "--model", "qwen2.5-7b", "--gpu", "l4", "--path", "hf-eager",
                   "--replace", cwd=tmp_path, env=SRC)
    assert proc.returncode == 2 and "--replace needs --db" in proc.stderr
    proc = run_cli("predict", "--model", "qwen2.5-7b", "--gpu", "l4", "--path", "engine-fp8-kvfp8",
                   cwd=tmp_path, env=SRC)
    assert proc.returncode == 2 and "no GPU cell of engine-fp8-kvfp8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_users_cells_add_to_the_shipped_ones_and_replace_the_same_cell():
    base = shipped()
    measured = next(c for c in base.cells
                    if (c["path"], c["model"], c["ctx"]) == ("engine", "qwen2.5-7b", 2048))
    rows = [CellRow(id=7, status="valid", gpu=g, path="engine", model="qwen2.5-7b", ctx=2048,
                    steps=8, warmup=2, median_ms=ms, weight_format="bf16", kv_dtype="bf16",
                    fingerprint_key="env", finished_at="x")
            for g, ms in (("h200", 5.0), ("l4", 70.0))]
    cal = combine(base, from_rows(rows, [], {}, "mine"))
    mine = ("engine", "qwen2.5-7b", 2048, "h200")
    same = [c for c in cal.cells if (c["path"], c["model"], c["ctx"], c["gpu"]) == mine]
    assert [c["ms"] for c in same] == [5.0] and measured["ms"] != 5.0
    assert len(cal.cells) == len(base.cells) + 1
    f = forecast(cal, "qwen2.5-7b", "l4", 2048, "engine")
    assert f.fit.gpus == {"h200", "l4"}
    assert not any("no cell of engine on l4" in n for n in f.notes())


def test_published_cells_as_printed_or_from_the_published_fraction():
    study = {"fraction_of_floor": [
                {"gpu": "l4", "model": "qwen2.5-7b", "ctx": 2048, "path": "hf-eager", "value": 0.8},
                {"gpu": "h100-sxm5", "model": "qwen2.5-7b", "ctx": 2048, "path": "hf-eager",
                 "value": 0.25}],
             "quantised_ms": [{"gpu": "l4", "path": "bf16", "ms": 60.0},
                              {"gpu": "l4", "path": "GPTQ+ExLlamaV2", "ms": 20.0}]}
    rows = {(r["gpu"], r["path"]): r["published_ms"] for r in published_cells(study)}
    h100 = floor(resolve_model("qwen2.5-7b"), lookup("h100-sxm5"), 2048).floor_ms_all_params
    assert rows == {("l4", "hf-eager"): 60.0, ("h100-sxm5", "hf-eager"): pytest.approx(h100 / 0.25),
                    ("l4", "gptq-exllamav2"): 20.0}


def test_predict_json_names_every_term_and_its_source(tmp_path):
    proc = run_cli("predict", "--model", "llama-3.1-8b", "--gpu", "h200", "--path", "hf-eager",
                   "--ctx", "4096", "--json", cwd=tmp_path, check=True, env=SRC)
    f = json.loads(proc.stdout)
    assert f["kind"] == "host-bound" and f["low"] < f["ms"] < f["high"]
    assert f["ms"] == pytest.approx(max(f["gpu_ms"], f["host_ms"]))
    assert f["gpu_ms"] == pytest.approx(sum(f["gpu_parts_ms"].values()))
    terms = f["terms"]
    assert f["host_ms"] == pytest.approx(terms["launches per layer"]["value"] * 32
                                         * terms["host cost per launch"]["value"] / 1e3)
    assert all(t["source"] for t in terms.values())


@pytest.mark.parametrize("gpu, ctx, message", [
    ("h200", 2**31 - 1, "ctx 2147483647 is above llama-3.1-8b's 131072 positions"),
    ("h200", 10**6, "ctx 1000000 is above llama-3.1-8b's 131072 positions"),
    # 16.1 GB of weights and 17.2 GB of KV cache (128 KiB a position) in an L4's 24 GB
    ("l4", 131072, "holds 33.2 GB (weights 16.1, KV cache 17.2), more than the l4's 24 GB"),
])
def test_predict_refuses_a_step_that_cannot_run(tmp_path, gpu, ctx, message):
    proc = run_cli("predict", "--model", "llama-3.1-8b", "--path", "engine", "--gpu", gpu,
                   "--ctx", ctx, cwd=tmp_path, env=SRC)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("floorline: error: no forecast: ") and message in proc.stderr


def test_a_zero_median_in_the_database_is_refused_in_one_line(tmp_path):
    import sqlite3

    from floorline.records import VALID, CellKey, CellResult
    from floorline.store import Store

    db = tmp_path / "r.db"
    store = Store(db)
    for ctx in (2048, 16384):
        store.add(CellResult(CellKey("llama-3.1-8b", ctx, "engine", 8, 2), "h200", VALID, None,
                             [5.0], {"median_ms": 5.0}, {"floor_ms": 4.0, "total_bytes": 10**10}),
                  {}, "env")
    store.close()
    sqlite3.connect(db).execute("UPDATE cells SET median_ms = 0 WHERE id = 2").connection.commit()
    proc = run_cli("predict", "--model", "llama-3.1-8b", "--path", "engine", "--gpu", "h200",
                   "--db", db, cwd=tmp_path, env=SRC)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert (f"floorline: error: {db} cell 2: valid with median_ms 0.0, which no measured cell "
            "has (a damaged row)") in proc.stderr


def test_a_probe_of_the_users_host_gives_a_host_bound_forecast(tmp_path):
    # Without it: one line that names what is missing and the command that measures it.
    args = ("predict", "--model", "qwen2.5-7b", "--gpu", "h100-sxm5", "--path", "hf-eager")
    proc = run_cli(*args, cwd=tmp_path, env=SRC)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stdout == ""
    assert "no host was measured with the h100-sxm5" in proc.stderr
    assert "`floorline probe --db floorline.db`" in proc.stderr
    # A database holding only a probe of a machine with an H100, whose bare launch costs
    # 3.0 us: each of the shipped H200 cells' host cost per launch, scaled by 3.0 over the H200
    # probes' median, and their median.
    from floorline.store import Store

    db = tmp_path / "mine.db"
    store = Store(db)
    store.add_probe("cuda", {"eager_us": 3.0, "graph_us": 0.9, "stream_read_gbps": 3050.0},
                    {"device": "NVIDIA H100 80GB HBM3"}, "h100-env")
    store.close()
    proc = run_cli(*args, "--db", db, "--json", cwd=tmp_path, check=True, env=SRC)
    f = json.loads(proc.stdout)
    cal = shipped()
    h200_eager = statistics.median(p["eager_us"] for p in cal.probes)
    per_layer = next(e["kernels_per_step"] for e in cal.explanations
                     if e["path"] == "hf-eager") / 28
    expected = statistics.median(c["ms"] / (per_layer * layers(c["model"])) * 1e3 * 3.0
                                 / h200_eager for c in cal.cells if c["path"] == "hf-eager")
    assert f["terms"]["host cost per launch"]["value"] == pytest.approx(expected)
    assert f["terms"]["memory's streaming read"]["value"] == pytest.approx(3050 / 3350)
    assert f["host_ms"] == pytest.approx(per_layer * 28 * expected / 1e3)


def test_leave_one_gpu_out_forecasts_a_gpu_from_the_other_alone():
    # Two GPUs whose steps follow the model with different terms: the H200's weights stream at
    # 0.8 of peak, 10 us a layer, int4 0.2 ms a GB more; the H100's at 0.9, 12 us, 0.25 ms.
    # Held out, each H100 cell is forecast with the H200's terms alone.
    truth = {"h200": {"stream": 0.8, "tau_us": 10.0, "sm": 0.2},
             "h100-sxm5": {"stream": 0.9, "tau_us": 12.0, "sm": 0.25}}

    def engine_cell(gpu, model, ctx, path="engine", fmt="bf16"):
        t = truth[gpu]
        ms = synthetic(model, ctx, path, fmt, gpu, t["stream"], 0.5, t["tau_us"],
                       t["sm"] if fmt != "bf16" else 0.0)
        return cell(path, model, ctx, ms, gpu, fmt)

    cells, probes = [], []
    for gpu, t in truth.items():
        cells += [engine_cell(gpu, m, c) for m in ("qwen2.5-7b", "llama-3.1-8b")
                  for c in (2048, 16384)]
        cells += [engine_cell(gpu, "qwen2.5-7b", 2048, "engine-int4", "engine-int4")]
        cells += [engine_cell(gpu, "qwen3-0.6b", c) for c in (128, 512)]
        cells += [cell("hf-eager", "qwen2.5-7b", c, 56.0, gpu) for c in (2048, 8192)]
        probes.append({"gpu": gpu, "eager_us": 7.0, "graph_us": GRAPH_US,
                       "stream_read_gbps": t["stream"] * PEAK[gpu] / 1e6, "source": "probe"})
    cells += [cell("hf-static+graphs", "qwen2.5-7b", c,
                   synthetic("qwen2.5-7b", c, "hf-static", eta_a=0.2, stream=0.8) + 1.0)
              for c in (2048, 16384)]
    cal = Calibration(cells, [EAGER_EXPLAIN], probes)
    rows = leave_one_gpu_out(cal, "h100-sxm5")
    assert {r["gpu"] for r in rows} == {"h100-sxm5"} and len(rows) == 9

    h200 = truth["h200"]
    errors = {}
    for c in cells:
        if c["gpu"] != "h100-sxm5" or c["path"] == "hf-eager":
            continue
        fmt = c["weight_format"]
        forecast_ms = synthetic(c["model"], c["ctx"], c["path"], fmt, "h100-sxm5", h200["stream"],
                                0.5, h200["tau_us"], h200["sm"] if fmt != "bf16" else 0.0)
        errors[(c["path"], c["model"], c["ctx"])] = (forecast_ms - c["ms"]) / c["ms"]
    got = {(r["path"], r["model"], r["ctx"]): r["error"] for r in rows if r["error"] is not None}
    assert got.keys() == errors.keys()
    assert all(got[k] == pytest.approx(errors[k]) for k in errors)
    refused = [r for r in rows if r["error"] is None]
    assert [r["path"] for r in refused] == ["hf-eager", "hf-eager"]
    assert all("no host was measured with the h100-sxm5" in r["missing"] for r in refused)

    # With the H100's probe in hand: its streaming read (0.9) in place of the H200's, and its
    # host's launch cost, so the eager cells are forecast too (the same 7 us a bare launch:
    # the H200 host's 40 us a launch, 56 ms)
    probed = {(r["path"], r["model"], r["ctx"]): r for r in
              leave_one_gpu_out(cal, "h100-sxm5", probed=True)}
    for (path, model, ctx), r in probed.items():
        c = next(c for c in cells if (c["gpu"], c["path"], c["model"], c["ctx"])
                 == ("h100-sxm5", path, model, ctx))
        fmt = c["weight_format"]
        expected = 56.0 if path == "hf-eager" else synthetic(
            model, ctx, path, fmt, "h100-sxm5", truth["h100-sxm5"]["stream"], 0.5,
            h200["tau_us"], h200["sm"] if fmt != "bf16" else 0.0)
        assert r["forecast_ms"] == pytest.approx(expected)
    assert len(cal.probes) == 2  # the calibration given is left as it was

    families = by_family(rows)
    small = [errors[("engine", "qwen3-0.6b", c)] for c in (128, 512)]
    big = [errors[("engine", m, c)] for m in ("qwen2.5-7b", "llama-3.1-8b") for c in (2048, 16384)]
    assert families[SMALL]["mae"] == pytest.approx(sum(map(abs, small)) / 2)
    assert families["engine, bf16"]["mae"] == pytest.approx(sum(map(abs, big)) / 4)
    assert families["engine, bf16"]["worst"] == pytest.approx(max(big, key=abs))
    assert families["engine, int4"]["cells"] == 1
    assert families["engine, int4"]["worst"] == pytest.approx(
        errors[("engine-int4", "qwen2.5-7b", 2048)])
    assert families["stock, host-bound"] == {"cells": 0, "not_forecast": 2, "mae": None,
                                             "worst": None, "with_interval": 0, "held": 0}


def test_each_architecture_probed_on_a_machine_counts(tmp_path):
    # Three probes of one machine, each with its model's layer: the newest probe's figures,
    # and every architecture's layer, the newer of two Qwen2 readings.
    from floorline.store import Store

    store = Store(tmp_path / "r.db")
    env = {"device": "NVIDIA H100 80GB HBM3"}
    for arch, layer_us in (("qwen2", 900.0), ("llama", 650.0), ("qwen2", 600.0)):
        host = {"layer_us": layer_us, "step_us": 400.0, "architecture": arch}
        store.add_probe("cuda", {"eager_us": layer_us / 100, "graph_us": 0.9,
                                 "stream_read_gbps": 3050.0,
                                 "host_layer": {"hf-eager": host,
                                                "hf-static": {"reason": "busy"}}}, env, "env")
    probes = store.probes()
    store.close()
    assert probes["env"]["eager_us"] == 6.0
    assert sorted((h["architecture"], h["layer_us"]) for h in probes["env"]["host_layers"]) == [
        ("llama", 650.0), ("qwen2", 600.0)]
    cal = from_rows([], [], probes, "mine", {"env": env["device"]})
    for model, layer_us in (("qwen2.5-7b", 600.0), ("llama-3.1-8b", 650.0)):
        f = fit(combine(eager_calibration([PROBE]), cal), "hf-eager", "h100-sxm5", model)
        assert f.terms["host time per layer"].value == layer_us
