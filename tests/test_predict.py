"""The forecast against arithmetic on cells whose terms are known."""

import pytest

from conftest import run_cli
from floorline.errors import FloorlineError
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.predict import fit_path, forecast_with, leave_one_out, predict
from floorline.traffic import floor


def cell(i, path, model, ctx, ms, gpu="h200"):
    f = floor(resolve_model(model), lookup(gpu), ctx)
    return {"id": i, "path": path, "model": model, "ctx": ctx, "gpu": gpu, "status": "valid",
            "median_ms": ms, "floor_ms": f.floor_ms, "fraction_of_floor": f.floor_ms / ms,
            "peak_gbps": lookup(gpu).peak_gbps, "fingerprint_key": "env"}


def test_gpu_bound_path_scales_with_bandwidth():
    # Graph-replayed cells at 50% of the floor on an H200: on an L4 the same share of 300 GB/s.
    qwen, h200 = resolve_model("qwen2.5-7b"), lookup("h200")
    cells = [cell(i, "hf-static+graphs", "qwen2.5-7b", c, floor(qwen, h200, c).floor_ms / 0.5)
             for i, c in enumerate((2048, 8192))]
    f = predict("qwen2.5-7b", "l4", 4096, "hf-static+graphs", cells, [], {})
    assert f.ms == pytest.approx(floor(resolve_model("qwen2.5-7b"), lookup("l4"), 4096).floor_ms / 0.5)
    assert f.host_ms == 0 and f.fit.bound == "gpu"
    assert any("l4 was not measured" in n for n in f.fit.notes)


def test_host_bound_path_keeps_its_host_time_per_layer():
    # 28 layers at 2 ms each on the host: the H100's GPU side is far below, the host governs.
    cells = [cell(i, "hf-eager", "qwen2.5-7b", c, 56.0) for i, c in enumerate((2048, 4096, 8192))]
    probes = {"env": {"stream_read_gbps": 4000}}
    fit = fit_path("hf-eager", cells, [], probes)
    assert fit.bound == "host" and fit.host_ms_per_layer == pytest.approx(2.0)
    assert fit.efficiency == pytest.approx(4000 / 4800)
    f = forecast_with(fit, "llama-3.1-8b", "h100-sxm5", 2048, [])
    assert f.ms == pytest.approx(2.0 * 32)  # Llama-3.1-8B has 32 layers
    slow = forecast_with(fit, "qwen2.5-7b", "jetson-agx-orin", 2048, [])
    expected_gpu = floor(resolve_model("qwen2.5-7b"), lookup("jetson-agx-orin"), 2048).floor_ms / (4000 / 4800)
    assert slow.ms == pytest.approx(expected_gpu) and slow.gpu_ms > slow.host_ms


def test_explain_sets_efficiency_and_fixed_kernels():
    cells = [cell(0, "hf-static+graphs", "qwen2.5-7b", 2048, 8.0)]
    d = {"floor_ms": 3.0, "lost_in_kernels_ms": 1.0, "other_kernels_ms": 2.5,
         "launch_and_idle_ms": 0.5, "median_ms": 7.0}
    fit = fit_path("hf-static+graphs", cells, [{"path": "hf-static+graphs", "gpu": "h200", "ctx": 2048,
                                                "decomposition": d}], {})
    assert (fit.efficiency, fit.fixed_ms, fit.bound) == (pytest.approx(0.75), 2.5, "gpu")


def test_leave_one_out_forecasts_each_cell_from_the_others():
    cells = [cell(0, "hf-eager", "qwen2.5-7b", 2048, 50.0), cell(1, "hf-eager", "qwen2.5-7b", 4096, 60.0),
             cell(2, "hf-eager", "qwen2.5-7b", 8192, 70.0)]
    loo = {r["id"]: r for r in leave_one_out(cells, [], {})}
    # Without cell 0 the host time per layer is the median of 60/28 and 70/28.
    assert loo[0]["forecast_ms"] == pytest.approx(65.0)
    assert loo[0]["error"] == pytest.approx((65 - 50) / 50)
    f = predict("qwen2.5-7b", "h200", 2048, "hf-eager", cells, [], {})
    errors = sorted(r["error"] for r in loo.values())
    assert f.low < f.ms < f.high and f.high == pytest.approx(f.ms / (1 + (errors[0] + 0.1 * (errors[1] - errors[0]))))


def test_a_path_with_no_cells_is_refused(tmp_path):
    with pytest.raises(FloorlineError, match="no valid cells of path hf-static"):
        predict("qwen2.5-7b", "l4", 2048, "hf-static", [], [], {})
    proc = run_cli("predict", "--model", "qwen2.5-7b", "--gpu", "l9", "--path", "hf-eager",
                   "--db", tmp_path / "none.db")
    assert proc.returncode == 2 and "no results database" in proc.stderr
