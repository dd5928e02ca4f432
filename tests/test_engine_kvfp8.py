"""The engine's fp8 KV cache: its quantiser, the decode kernel that writes and reads it (under
Triton's interpreter, against the PyTorch reference), the engine's logits beside a 16-bit cache,
chunked prefill, the floor's bytes, the paths and their cells, and bad options."""

import json

import pytest
import torch
from tests.conftest import moved, run_here

from floorline.engine import Engine
from floorline.engine.check import relative_error
from floorline.engine.kernels.attention import (
    attention_scratch,
    decode_attention,
    decode_attention_reference,
)
from floorline.engine.kvcache import FP8, KVCache, dequantise, quantise
from floorline.engine.model import EngineUnsupported
from floorline.errors import FloorlineError
from floorline.hardware import lookup
from floorline.measure import runner
from floorline.measure.sweep import default_grid
from floorline.models import resolve_model
from floorline.paths import REGISTRY
from floorline.traffic import floor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.arange(256, dtype=torch.uint8).view(FP8).float()
E4M3 = E4M3[E4M3.isfinite()]  # every finite e4m3 value


def test_quantise_uses_the_whole_e4m3_range_per_vector():
    g = torch.Generator().manual_seed(0)
    # head vectors whose magnitudes spread over twelve orders, one all zero
    x = torch.randn(3, 50, 32, generator=g) * 10.0 ** torch.randint(-6, 6, (3, 50, 1), generator=g)
    x[1, 7] = 0
    q, s = quantise(x)
    assert q.dtype == FP8 and s.shape == (3, 50) and s.dtype == torch.float32
    amax = x.abs().amax(dim=-1)
    assert torch.equal(s, amax / 448)
    assert s[1, 7] == 0 and not q[1, 7].float().any()
    values = q.float()
    # every value is on e4m3's grid, and each vector's largest lands on 448
    assert torch.isin(values, E4M3).all()
    live = amax > 0
    assert torch.equal(values.abs().amax(dim=-1)[live], torch.full_like(amax[live], 448.0))
    # round to nearest: within half of e4m3's step, 2^-4 of a normal value, 2^-10 below 2^-6
    y = dequantise(q, s, torch.float32)
    bound = (x.abs() * 2.0 ** -4 + s[..., None] * 2.0 ** -10) * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all()


def fp8_attention_case(dtype, pos, window, splits, seed, heads=6, kv_heads=2, d=32,
                       capacity=40):
    """The kernel and the reference on one fp8 cache; each result is (out, K, V, K scales,
    V scales), V token-major (the cache holds it transposed)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(shape, generator=g).to(DEVICE)

    qkv = draw((heads + 2 * kv_heads) * d).to(dtype)
    # cached tokens of unequal norms, so that a scale read for the wrong token shows
    cache = KVCache.allocate("fp8", 1, kv_heads, capacity, d, dtype, DEVICE)
    cache.write(0, 0, *(draw(kv_heads, capacity, d) * draw(kv_heads, capacity, 1).exp()
                        for _ in "kv"))
    stored = (cache.k[0], cache.v[0], cache.k_scale[0], cache.v_scale[0])
    angles = draw(capacity, d // 2)
    position = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    results = []
    for kernel, scratch in ((decode_attention, attention_scratch(heads, d, splits, DEVICE)),
                            (decode_attention_reference, None)):
        k, v, ks, vs = (t.clone() for t in stored)
        out = torch.full((heads * d,), float("nan"), dtype=dtype, device=DEVICE)
        kernel(qkv.clone(), k, v, angles.cos(), angles.sin(), position, out, scale=d ** -0.5,
               window=window, scratch=scratch, block_t=32, scales=(ks, vs))
        results.append((out, k, v.transpose(1, 2), ks, vs))
    k, v, ks, vs = stored
    return ((k, ks), (v.transpose(1, 2), vs)), results


# first token, several blocks, last slot; each with and without a window, the dtypes turning
# so that each meets every position and both windows
@pytest.mark.parametrize("pos, window, dtype", [
    (0, None, torch.float32), (0, 6, torch.bfloat16), (17, None, torch.bfloat16),
    (17, 6, torch.float32), (39, None, torch.float32), (39, 6, torch.bfloat16)])
def test_fp8_write_and_decode_attention_match_the_reference(pos, window, dtype):
    before, (mine, ref) = fp8_attention_case(dtype, pos, window, splits=4, seed=pos)
    assert relative_error(mine[0], ref[0]) < (1e-5 if dtype == torch.float32 else 2e-2)
    (k0, ks0), (v0, vs0) = before
    for i, (got, want, old) in enumerate(zip(mine[1:], ref[1:], (k0, v0, ks0, vs0))):
        # the new token's quantised k and v and their scales land at pos, nothing else moves
        keep = torch.arange(got.shape[1], device=DEVICE) != pos
        assert torch.equal(got[:, keep].float(), old[:, keep].float())
        if dtype == torch.float32 or i % 2:  # v as it came; k rotated in fp32 both ways
            assert torch.equal(got[:, pos].float(), want[:, pos].float())
    # in bf16 the rotated k may round to a neighbouring bf16 value, and with it the vector's
    # scale: then values move by up to an e4m3 step (1/16), a few percent over the vector
    k, ks, ref_k, ref_ks = mine[1], mine[3], ref[1], ref[3]
    assert relative_error(dequantise(k[:, pos], ks[:, pos], torch.float32),
                          dequantise(ref_k[:, pos], ref_ks[:, pos], torch.float32)) < 4e-2
    # and what was written is the new v quantised (v is not rotated): independent of the kernel
    heads, kv_heads, d = 6, 2, 32
    qkv = torch.randn((heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(pos))
    v_new = qkv.to(dtype)[(heads + kv_heads) * d:].view(kv_heads, d).float()
    assert relative_error(dequantise(mine[2][:, pos], mine[4][:, pos], torch.float32).cpu(),
                          v_new) < 4e-2


@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (40, 2)])  # no GQA; a group above 16
def test_fp8_decode_attention_group_sizes(heads, kv_heads):
    _, (mine, ref) = fp8_attention_case(torch.float32, 37, 30, splits=4, seed=2, heads=heads,
                                        kv_heads=kv_heads)
    assert relative_error(mine[0], ref[0]) < 1e-5


def test_fp8_decode_attention_with_empty_splits():
    # 32 chunks over 12 tokens: most programs find an empty span and must not count
    _, (mine, ref) = fp8_attention_case(torch.float32, 11, None, splits=32, seed=1)
    assert relative_error(mine[0], ref[0]) < 1e-5


def test_the_kernels_refuse_an_fp8_cache_without_scales():
    k = torch.zeros(2, 8, 16, dtype=FP8, device=DEVICE)
    with pytest.raises(ValueError, match="needs its scales"):
        decode_attention_reference(torch.zeros(128, device=DEVICE), k, k.clone(),
                                   torch.ones(8, 8, device=DEVICE),
                                   torch.zeros(8, 8, device=DEVICE),
                                   torch.zeros(1, dtype=torch.int32, device=DEVICE),
                                   torch.empty(64, device=DEVICE), scale=0.25, window=None)


def test_the_kernels_refuse_an_fp8_v_not_transposed():
    k = torch.zeros(2, 8, 16, dtype=FP8, device=DEVICE)
    scales = (torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"V is \[kv heads, head_dim, slots\]"):
        decode_attention_reference(torch.zeros(128, device=DEVICE), k, k.clone(),
                                   torch.ones(8, 8, device=DEVICE),
                                   torch.zeros(8, 8, device=DEVICE),
                                   torch.zeros(1, dtype=torch.int32, device=DEVICE),
                                   torch.empty(64, device=DEVICE), scale=0.25, window=None,
                                   scales=scales)


def test_the_kernel_refuses_fp8_products_the_tensor_cores_cannot_sum():
    # a 16-bit model's fp8-cache products run on the tensor cores, which sum 8-bit values over
    # 32 or more: heads of 16, or blocks of 16 cached tokens, cannot be compiled
    for d, block_t, problem in ((16, 64, "head_dim 16"), (32, 16, "blocks of 16 cached tokens")):
        cache = KVCache.allocate("fp8", 1, 2, 8, d, torch.bfloat16, DEVICE)
        with pytest.raises(ValueError, match=problem):
            decode_attention(torch.zeros(8 * d, dtype=torch.bfloat16, device=DEVICE),
                             cache.k[0], cache.v[0], torch.ones(8, d // 2, device=DEVICE),
                             torch.zeros(8, d // 2, device=DEVICE),
                             torch.zeros(1, dtype=torch.int32, device=DEVICE),
                             torch.empty(4 * d, dtype=torch.bfloat16, device=DEVICE),
                             scale=0.25, window=None, scratch=attention_scratch(4, d, 2, DEVICE),
                             block_t=block_t, scales=cache.scales(0))


def test_the_kernel_refuses_fp8_tiles_longer_than_the_cache_slack():
    cache = KVCache.allocate("fp8", 1, 2, 8, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="block_t 512 is too long"):
        decode_attention(torch.zeros(128, device=DEVICE), cache.k[0], cache.v[0],
                         torch.ones(8, 8, device=DEVICE), torch.zeros(8, 8, device=DEVICE),
                         torch.zeros(1, dtype=torch.int32, device=DEVICE),
                         torch.empty(64, device=DEVICE), scale=0.25, window=None,
                         scratch=attention_scratch(4, 16, 2, DEVICE), block_t=512,
                         scales=cache.scales(0))


def teacher_forced(spec, dtype, n, steps, backend=None, other_backend=None):
    """Relative error of the fp8-cache engine's logits against the 16-bit-cache engine's (or,
    with other_backend, against the fp8 engine on that backend), per position."""
    def device(backend):  # the kernels run where they are compiled or interpreted
        return DEVICE if backend == "triton" else "cpu"
    first = Engine(spec, device(backend), n + steps + 1, dtype=dtype, kv="fp8", backend=backend)
    second = Engine(spec, device(other_backend), n + steps + 1, dtype=dtype,
                    kv="fp8" if other_backend else "bf16", backend=other_backend,
                    decoder_weights=moved(first.decoder.w, device(other_backend)))
    tokens = torch.randint(first.config.vocab, (n,), generator=torch.Generator().manual_seed(n))
    errors = [relative_error(first.prefill(tokens).cpu(), second.prefill(tokens).cpu())]
    for _ in range(steps):
        first.token.copy_(second.token)
        first.step(), second.step()
        errors.append(relative_error(first.logits.cpu(), second.logits.cpu()))
    return errors


@pytest.mark.parametrize("name, dtype", [("tiny-llama", torch.float32),
                                         ("tiny-qwen2", torch.bfloat16),
                                         ("tiny-mistral-swa", torch.float32)])
def test_an_fp8_cache_keeps_the_logits_near_the_16bit_cache(name, dtype):
    n = 260 if name == "tiny-mistral-swa" else 40  # past the 256-token window
    errors = teacher_forced(resolve_model(name), dtype, n, steps=8)
    print(f"{name} {dtype}: fp8 vs 16-bit cache, logits relative error "
          + " ".join(f"{e:.1e}" for e in errors))
    # e4m3 rounds K and V by ~2.4% (tiny-llama: 0.5-2% on the logits); a cache read without its
    # scales, with the wrong token's or left unquantised would leave this band
    assert all(1e-4 < e < 0.1 for e in errors)


def test_the_fp8_kernels_decode_like_the_reference_in_the_engine():
    errors = teacher_forced(resolve_model("tiny-qwen2"), torch.float32, 6, steps=3,
                            backend="triton", other_backend="reference")
    assert max(errors) < 1e-5


@pytest.mark.parametrize("name, n, chunk", [("tiny-llama", 40, 7), ("tiny-mistral-swa", 300, 64)])
def test_chunked_prefill_leaves_the_fp8_cache_of_one_pass(name, n, chunk):
    spec = resolve_model(name)
    whole, chunked = (Engine(spec, "cpu", n + 2, dtype=torch.float32, kv="fp8") for _ in "ab")
    tokens = torch.randint(whole.config.vocab, (n,), generator=torch.Generator().manual_seed(n))
    a = whole.prefill(tokens)
    b = chunked.decoder.prefill(tokens, chunk=chunk)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    ours, theirs = chunked.decoder.cache, whole.decoder.cache
    for values, scales in (("k", "k_scale"), ("v", "v_scale")):
        # V is held transposed: its tokens are the last dimension
        mine, ref = (getattr(c, values).float() for c in (ours, theirs))
        mine, ref = (x[:, :, :n] if values == "k" else x[..., :n] for x in (mine, ref))
        # float noise between the two passes may move a value by one e4m3 step, rarely
        assert (mine == ref).float().mean() > 0.999
        assert torch.allclose(getattr(ours, scales)[:, :, :n], getattr(theirs, scales)[:, :, :n],
                              rtol=1e-5)
        assert not getattr(ours, scales)[:, :, n:].any()  # nothing written past the prompt


def test_the_floor_counts_fp8_kv_and_its_scales():
    h200 = lookup("h200")
    # Llama-3.1-8B: 32 layers x K and V x 8 kv heads x (128 fp8 bytes + a 4-byte scale) per
    # token, for 131072 cached tokens and the new one
    f = floor(resolve_model("llama-3.1-8b"), h200, 131072, "bf16", "engine-fp8")
    assert f.kv_bytes == 32 * 2 * 8 * (128 + 4) * 131073
    plain = floor(resolve_model("llama-3.1-8b"), h200, 131072, "bf16", "fp8")
    assert plain.kv_bytes == 32 * 2 * 8 * 128 * 131073
    assert f.total_bytes == f.weight_bytes + f.kv_bytes
    # Qwen2.5-7B: 28 layers, 4 kv heads; tiny-mistral-swa reads at most its 256-token window
    assert floor(resolve_model("qwen2.5-7b"), h200, 32768, "bf16", "engine-fp8").kv_bytes == \
        28 * 2 * 4 * (128 + 4) * 32769
    swa = resolve_model("tiny-mistral-swa").config
    layers, kv_heads = swa.num_hidden_layers, swa.num_key_value_heads
    head_dim = swa.hidden_size // swa.num_attention_heads
    assert floor(resolve_model("tiny-mistral-swa"), h200, 1000, "bf16", "engine-fp8").kv_bytes \
        == layers * 2 * kv_heads * (head_dim + 4) * 257


def test_the_kvfp8_paths():
    for name, weights in (("engine-kvfp8", "bf16"), ("engine-int4-kvfp8", "engine-int4"),
                          ("engine-fp8-kvfp8", "engine-fp8")):
        path = REGISTRY[name]
        assert (path.weight_format, path.kv_dtype, path.reference) == (weights, "engine-fp8",
                                                                       "engine")
    assert REGISTRY["engine"].kv_dtype == "bf16" and REGISTRY["engine-int4"].kv_dtype == "bf16"


@pytest.fixture(scope="module")
def one_worker():
    """One warm worker for this module's commands run here: the sweep would start one of its
    own, and explain a fresh interpreter, each importing torch again."""
    with runner.warm_worker("cpu"):
        yield


def test_kvfp8_cells_at_the_models_limit_with_their_time_to_first_token(tmp_path, one_worker):
    # tiny-qwen2 has 1024 positions: ctx 1024 runs with a prompt of 1024 - 4 tokens, so that
    # the last of 1 warm-up and 3 timed steps takes the last position
    db = tmp_path / "k.db"
    run_here("sweep", "--db", db, "--models", "tiny-qwen2", "--ctx", "1024", "--paths",
             "engine,engine-kvfp8", "--steps", "3", "--warmup", "1", "--device", "cpu", "--gpu",
             "h200", check=True)
    rows = {r["path"]: r
            for r in json.loads(run_here("show", "--db", db, "--json", check=True).stdout)}
    bf16, fp8 = rows["engine"], rows["engine-kvfp8"]
    spec = resolve_model("tiny-qwen2").config
    kv_heads, head_dim = spec.num_key_value_heads, spec.hidden_size // spec.num_attention_heads
    per_token = spec.num_hidden_layers * 2 * kv_heads
    assert bf16["kv_bytes"] == per_token * head_dim * 2 * 1025
    assert fp8["kv_bytes"] == per_token * (head_dim + 4) * 1025 and fp8["kv_dtype"] == "engine-fp8"
    assert fp8["weight_bytes"] == bf16["weight_bytes"]
    assert fp8["reduction"]["expected"] == pytest.approx(bf16["total_bytes"] / fp8["total_bytes"])
    for r in (bf16, fp8):
        d = r["details"]
        assert r["status"] == "valid" and d["prompt_tokens"] == 1020
        assert d["prefill_ms"] > 0
        assert d["prefill_tokens_per_s"] == pytest.approx(1020 / d["prefill_ms"] * 1e3)
    table = run_here("show", "--db", db, check=True).stdout
    assert "TTFT ms" in table and f"{fp8['details']['prefill_ms']:.1f}" in table
    assert default_grid("cuda").contexts == (2048, 4096, 8192, 16384)  # the default stays


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "tiny-llama", "--prompt", "hi", "--kv-dtype", "fp4"],
     "engine KV cache must be one of bf16, fp8, not 'fp4'"),
    (["floor", "--model", "tiny-llama", "--gpu", "h200", "--kv-dtype", "int4"],
     "unknown KV dtype 'int4'"),
])
def test_bad_kv_options_are_one_line(args, message):
    proc = run_here(*args)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    with pytest.raises(FloorlineError, match="not 'fp16'"):
        Engine(resolve_model("tiny-llama"), "cpu", 8, kv="fp16")


def test_heads_too_narrow_for_the_fp8_products_are_refused_at_load(cli, tmp_path):
    # tiny-qwen2's heads are 16 wide: its 16-bit fp8-cache attention cannot be compiled (the
    # tensor cores sum 8-bit values over 32 or more), so the kernels' engine refuses it at load
    # in one line, on the GPU as under the interpreter; float32 products and the CPU's
    # reference run it
    spec = resolve_model("tiny-qwen2")
    with pytest.raises(EngineUnsupported, match="head_dim 16: the fp8 KV cache's attention"):
        Engine(spec, DEVICE, 8, kv="fp8", backend="triton")
    Engine(spec, DEVICE, 8, dtype=torch.float32, kv="fp8", backend="triton")
    Engine(spec, "cpu", 8, kv="fp8", backend="reference")
    if DEVICE == "cuda":  # a sweep's cell on the GPU: invalid, with the reason
        db = tmp_path / "k.db"
        cli("sweep", "--models", "tiny-qwen2", "--ctx", "16", "--paths", "engine-kvfp8",
            "--steps", "2", "--warmup", "1", "--db", db, check=True)
        (cell,) = json.loads(cli("show", "--db", db, "--json", check=True).stdout)
        assert cell["status"] == "invalid" and "head_dim 16" in cell["reason"]


def test_explain_runs_an_fp8_kv_cell_at_the_models_limit(tmp_path, one_worker):
    proc = run_here("explain", "--model", "tiny-qwen2", "--ctx", "1024", "--path",
                    "engine-kvfp8", "--steps", "2", "--warmup", "1", "--device", "cpu", "--gpu",
                    "h200", "--db", tmp_path / "e.db", "--json", check=True)
    result = json.loads(proc.stdout)
    f = floor(resolve_model("tiny-qwen2"), lookup("h200"), 1024, "bf16", "engine-fp8")
    assert result["ctx"] == 1024 and result["decomposition"]["floor_ms"] == f.floor_ms
    assert result["classes"]["attention"]["bytes"] == f.kv_bytes
    proc = run_here("explain", "--model", "tiny-qwen2", "--ctx", "1025", "--path",
                    "engine-kvfp8", "--device", "cpu", "--gpu", "h200", "--db", tmp_path / "e.db")
    assert proc.returncode == 2 and "context above the model's limit: ctx 1025" in proc.stderr


def test_the_kv_error_bench_runs_on_a_tiny_config(tmp_path, monkeypatch):
    import runpy
    import sys
    from pathlib import Path

    # in this process: the script as `python bench/engine_kv_error.py ARGS` runs it, less the
    # interpreter's start
    out = tmp_path / "kv.json"
    script = Path(__file__).parents[1] / "bench" / "engine_kv_error.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "tiny-llama", "--ctx", "64",
                                      "--device", "cpu", "--dtype", "float32", "--json", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ctx"] == 64 and row["positions"] == 5 and 0 < row["rel_err_median"] < 0.1
    # e4m3's rounding: at most 1/16 of each value, about 2-3% over a vector
    assert all(0.01 < e["rel_l2"] < 0.05 for e in row["cache"].values())
