import json
import statistics

import pytest

from conftest import gpu_only, run_here
from floorline.hardware import lookup
from floorline.measure import probe as probe_module
from floorline.measure.explain import by_class, classify, decompose, exclusive, explain, union_us
from floorline.measure.probe import host_layer, probe
from floorline.measure.quality import RANDOM_WEIGHTS
from floorline.models import build_model, cut_down, resolve_model


def test_union_of_overlapping_intervals():
    assert union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert union_us([]) == 0


def test_overlapping_kernels_share_the_timeline_first_come():
    # Programmatic dependent launch: b starts at 3 while a runs to 4, c starts inside b. Each
    # instant goes to the kernel that started first among those running.
    spans = [("b", 3, 9), ("a", 0, 4), ("c", 8, 10), ("d", 12, 13)]
    shares = {name: own for name, _, _, own in exclusive(spans)}
    assert shares == {"a": 4, "b": 5, "c": 1, "d": 1}
    assert sum(shares.values()) == union_us([(s, e) for _, s, e in spans])


@pytest.mark.parametrize("name, cls", [
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, 128, 16, 4, 4>", "matrix-vector"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "matrix-vector"),
    ("pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>",
     "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>", "sampling"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms and rotary"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>",
     "elementwise"),
    ("aten::addmm", "matrix-vector"),
])
def test_kernel_classes(name, cls):
    assert classify(name) == cls


PARTS = ("floor_ms", "lost_in_kernels_ms", "other_kernels_ms", "launch_and_idle_ms")


def test_decomposition_sums_to_the_median():
    # Two steps: a GEMV of 4 us, an elementwise kernel of 2 us, then a GEMV of 4 us.
    events = [("gemv2T_kernel", 0, 4, 4), ("elementwise_add", 6, 8, 2),
              ("gemv2T_kernel", 10, 14, 4)]
    d = decompose(by_class(events, 2, {}), events, steps=2, median_ms=0.01, floor_ms=0.003)
    assert d["lost_in_kernels_ms"] == pytest.approx(0.004 - 0.003)
    assert d["other_kernels_ms"] == pytest.approx(0.001)
    assert d["launch_and_idle_ms"] == pytest.approx(0.01 - 0.005)
    assert d["busy_union_ms"] == pytest.approx(0.005)
    assert d["profiled_timeline_ms"] == pytest.approx(0.007)
    assert sum(d[k] for k in PARTS) == pytest.approx(d["median_ms"])


def test_a_scale_multiplies_every_class_and_the_parts_still_sum():
    events = [("gemv2T_kernel", 0, 4, 4), ("elementwise_add", 6, 8, 2),
              ("gemv2T_kernel", 10, 14, 4), ("elementwise_add", 16, 18, 2)]
    classes = by_class(events, 2, {"matrix-vector": 8000}, scale=0.5)
    assert classes["matrix-vector"]["ms"] == pytest.approx(0.002)
    assert classes["matrix-vector"]["gbps"] == pytest.approx(8000 / (0.002 * 1e6))
    d = decompose(classes, events, steps=2, median_ms=0.0045, floor_ms=0.001, scale=0.5)
    assert d["kernel_ms"] == pytest.approx(0.003) and d["profiler_scale"] == 0.5
    assert d["launch_and_idle_ms"] == pytest.approx(0.0015)
    assert sum(d[k] for k in PARTS) == pytest.approx(d["median_ms"])


def test_explain_a_tiny_cell_on_the_cpu():
    r = explain("tiny-llama", 32, "hf-static", "cpu", lookup("l4"), steps=4, warmup=2)
    d = r["decomposition"]
    # The host's operators are split on the profiled timeline, scaled to the unprofiled median,
    # so that no share is negative whatever the host's load.
    assert d["profiler_scale"] == pytest.approx(d["median_ms"] / d["profiled_timeline_ms"])
    assert all(d[k] >= 0 for k in PARTS)  # never a negative share
    assert sum(d[k] for k in PARTS) == pytest.approx(d["median_ms"])
    assert sum(c["ms"] for c in r["classes"].values()) == pytest.approx(d["kernel_ms"])
    mv = r["classes"]["matrix-vector"]
    # Two layers x 7 linears + the LM head: 15 matrix products a step.
    assert mv["kernels_per_step"] >= 15 and mv["ms"] > 0 and mv["gbps"] > 0
    assert r["classes"]["sampling"]["kernels_per_step"] == 1
    # per layer: the step beyond its floor, and its parts, over tiny-llama's two layers
    layer = r["per_layer"]
    assert layer["layers"] == 2
    assert layer["fixed_us"] == pytest.approx((d["median_ms"] - d["floor_ms"]) * 1e3 / 2)
    assert layer["fixed_us"] == pytest.approx(sum(layer[k] for k in (
        "lost_in_kernels_us", "other_kernels_us", "launch_and_idle_us")))


@gpu_only("the engine's graph-replayed kernels under the profiler, which overlap (programmatic "
          "dependent launch) and each take the profiler's own cost")
def test_explain_splits_the_engines_graphed_step_on_a_gpu():
    from floorline.hardware import detect

    # qwen3-0.6b's weights (1.2 GB) do not stay in the cache between steps
    r = explain("qwen3-0.6b", 128, "engine", "cuda", detect("cuda"), steps=8, warmup=16)
    d, layer = r["decomposition"], r["per_layer"]
    assert all(d[k] >= 0 for k in PARTS) and sum(d[k] for k in PARTS) == pytest.approx(
        d["median_ms"])
    # the kernels' shares sum to the time the GPU was busy, whatever their overlap
    assert d["kernel_ms"] == pytest.approx(d["busy_union_ms"] * d["profiler_scale"])
    assert layer["layers"] == 28 and layer["kernels"] == pytest.approx(
        r["kernels_per_step"] / 28)
    assert layer["fixed_us"] == pytest.approx((d["median_ms"] - d["floor_ms"]) * 1e3 / 28)


def test_probe_on_the_cpu_and_in_the_cells_table(tmp_path):
    r = probe("cpu", None, buffer_mib=8, budget_mib=64)
    assert r["stream_read_gbps"] > 0 and r["copy_gbps"] > 0 and r["eager_us"] > 0
    assert r["graph_us"] is None and r["sync_us"] is None
    db = tmp_path / "r.db"
    run_here("sweep", "--db", db, "--models", "tiny-llama", "--ctx", "16", "--steps", "3",
             "--paths", "hf-eager", "--device", "cpu", "--gpu", "l4", check=True)
    probed = json.loads(run_here("probe", "--db", db, "--device", "cpu", "--buffer-mib", "8",
                                 "--model", "tiny-llama", "--json", check=True).stdout)
    assert set(probed["gemv_gbps"]) >= {"384x128", "1024x128"}
    # the host's layer: the median over rounds of the steps' difference at 5 and 1 layers
    for path in ("hf-eager", "hf-static"):
        host = probed["host_layer"][path]
        assert host["architecture"] == "llama" and host["layer_us"] > 0
        assert host["layer_us"] == statistics.median(r[0] for r in host["rounds_us"])
        assert host["step_us"] == statistics.median(r[1] for r in host["rounds_us"])
    cell = json.loads(run_here("show", "--db", db, "--json", check=True).stdout)[0]
    expected = cell["total_bytes"] / (probed["stream_read_gbps"] * 1e6) / cell["median_ms"]
    shown = run_here("show", "--db", db, check=True).stdout
    assert f"{expected:.1%}" in shown
    # its one cell of random weights: quality noted as not measured, once, in no column
    assert shown.count(f"quality: {RANDOM_WEIGHTS}") == 1 and "ppl vs fp32" not in shown


@pytest.mark.parametrize("name", ["qwen2.5-7b", "gemma-3-4b", "phi-4-mini"])
def test_a_model_cut_down_runs_its_own_layer_on_a_few_mb(name):
    # The probe's host layer: the architecture's own modules, two layers, small tensors (the
    # heads as the model has them, 8 wide in the hidden state).
    import torch
    from transformers import AutoModelForCausalLM

    spec = resolve_model(name)
    cut = build_model(cut_down(spec, 2), "cpu", torch.bfloat16)
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(spec.config.get_text_config())

    def modules(layer):
        return [type(m).__name__ for m in layer.modules()]

    assert len(cut.model.layers) == 2 and modules(cut.model.layers[0]) == modules(
        full.model.layers[0])
    assert sum(p.numel() for p in cut.parameters()) < 2 * 3_000_000


def test_the_host_layer_from_rounds_of_both_depths(monkeypatch):
    # Steps of 1.5 ms at 1 layer and 3.5 ms at 5: 500 us a layer, 1000 us the rest; a round
    # whose host was busy (both depths 3x as slow) does not move the medians.
    spec = resolve_model("tiny-llama")
    times = iter([1.5, 3.5, 1.5, 3.5, 4.5, 10.5, 1.5, 3.5, 1.5, 3.5] * 2)
    monkeypatch.setattr(probe_module, "_step_ms", lambda path, model, device: next(times))
    host = host_layer("cpu", spec)["hf-eager"]
    assert host["layer_us"] == pytest.approx(500.0) and host["step_us"] == pytest.approx(1000.0)
    assert host["rounds_us"][2] == pytest.approx([1500.0, 3000.0])


def test_the_host_layer_says_why_where_it_cannot_be_read(monkeypatch):
    spec = resolve_model("tiny-llama")
    monkeypatch.setattr(probe_module, "_step_ms", lambda path, model, device: 1.0)
    reason = host_layer("cpu", spec)["hf-eager"]["reason"]
    assert "at 5 layers was not slower than at 1 in most of 5 rounds" in reason

    def broken(path, model, device):
        raise ValueError("no such layer")

    monkeypatch.setattr(probe_module, "_step_ms", broken)
    assert host_layer("cpu", spec)["hf-static"] == {
        "reason": "the model cut to a few layers did not run: ValueError: no such layer"}
