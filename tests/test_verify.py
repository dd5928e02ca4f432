"""The engine's k-token verify step against k single decode steps: the same logits and the
same cache, in every weight and cache format, on held-out family configs."""

import pytest
import torch
from tests.conftest import KERNEL_DEVICE, moved, run_here
from tests.test_engine_families import spec as family_spec

from floorline.engine import Engine
from floorline.engine.model import VERIFY_MAX
from floorline.errors import FloorlineError
from floorline.models import resolve_model

PROMPT = [3, 17, 42, 5, 99, 7, 64, 12, 8, 30, 21, 2]


def engine(spec, backend="reference", **formats) -> Engine:
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    return Engine(spec, device, 96, dtype=torch.float32, backend=backend, seed=1, **formats)


def single_steps(spec, prompt, k, **formats):
    """k decode steps after `prompt`: each step's input token and logits, and the engine."""
    e = engine(spec, **formats)
    e.prefill(torch.tensor(prompt))
    inputs, logits = [], []
    for _ in range(k):
        inputs.append(e.token.item())
        e.step()
        logits.append(e.logits.clone())
    return inputs, torch.stack(logits), e


def cache_of(e, upto):
    cache = e.decoder.cache
    parts = [cache.k[..., :upto, :], cache.v[..., :upto, :] if cache.v.shape == cache.k.shape
             else cache.v[..., :upto]]
    if cache.scales(0) is not None:
        parts += [s[..., :upto] for i in range(len(cache.k)) for s in cache.scales(i)]
    return [p.float() for p in parts]


@pytest.mark.parametrize("spec, formats", [
    (resolve_model("tiny-llama"), {}),
    (resolve_model("tiny-qwen2"), {"weights": "int4", "group_size": 32}),
    (resolve_model("tiny-llama"), {"weights": "fp8", "head": "fp8"}),
    (resolve_model("tiny-qwen2"), {"kv": "fp8"}),
    (family_spec("gemma3"), {}),  # post-norms, soft-capped logits, a window of 24 crossed
    (family_spec("phi3-longrope"), {}),  # partial rotary; long factors from position 40 on
    (family_spec("qwen3"), {}),  # q and k norms
], ids=lambda v: v.name if hasattr(v, "name") else "-".join(map(str, v.values())) or "bf16")
def test_a_verify_step_equals_k_single_steps(spec, formats):
    k = 8
    # Past the prompt by 20 positions first, so that Gemma's window and Phi-3's original length
    # of 40 fall inside the verified tokens.
    e = engine(spec, **formats)
    e.prefill(torch.tensor(PROMPT * 3))
    start = e.filled
    base_inputs, base_logits, reference = single_steps(spec, PROMPT * 3, k, **formats)
    rows = e.verify(base_inputs[1:])
    assert torch.allclose(rows.logits, base_logits, rtol=1e-5, atol=1e-5)
    assert rows.next.tolist() == base_logits.argmax(-1).tolist()
    for mine, theirs in zip(cache_of(e, start + k), cache_of(reference, start + k)):
        assert (mine - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    # token and position are the caller's to move: accepting all k continues as the steps did
    assert e.position.item() == start
    e.seek(start + k, rows.next[k - 1].item())
    e.step()
    reference.step()
    assert torch.allclose(e.logits, reference.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [1, 2])
def test_the_kernels_verify_as_the_reference_does(split_k, monkeypatch):
    # the Triton products for several rows and the per-token attention, in the interpreter;
    # split, every rows product's splits meet in partials shared by the layers' launches
    from floorline.engine import tuning
    from floorline.engine.kernels.gemv import GemvConfig

    if split_k > 1:  # every product, the GEMVs' and the rows products', split in two, in
        # 128 columns a program: as many programs as unsplit (the interpreter's time is per program)
        monkeypatch.setattr(tuning.GemvTuner, "config",
                            lambda self, w, out, **flags: GemvConfig(128, 64, split_k=2))
    spec = resolve_model("tiny-llama")
    mine = engine(spec, backend="triton")
    theirs = Engine(spec, "cpu", 96, dtype=torch.float32, backend="reference",
                    decoder_weights=moved(mine.decoder.w, "cpu"))
    for e in (mine, theirs):
        e.prefill(torch.tensor(PROMPT))
    drafts = [5, 6, 7]
    a, b = mine.verify(drafts), theirs.verify(drafts)
    assert torch.allclose(a.logits.cpu(), b.logits, rtol=1e-4, atol=1e-4)
    assert a.next.tolist() == b.next.tolist()


def test_a_verify_step_past_the_cache_or_too_long_is_refused():
    e = engine(resolve_model("tiny-llama"))
    e.prefill(torch.tensor(PROMPT))
    with pytest.raises(FloorlineError, match=f"1 to {VERIFY_MAX} tokens"):
        e.verify([1] * VERIFY_MAX)
    small = Engine(resolve_model("tiny-llama"), "cpu", len(PROMPT) + 3, dtype=torch.float32)
    small.prefill(torch.tensor(PROMPT))
    with pytest.raises(FloorlineError, match="no room"):
        small.verify([1, 2, 3])


ROWS_FORMATS = [(fmt, dtype) for fmt in ("bf16", "int4", "fp8")
                for dtype in (torch.float32, torch.bfloat16)]
ROWS_FUSIONS = ["norm-bias", "swiglu", "gelu", "accumulate"]
# every format and dtype at every split, the fusions turning through them so that each fusion
# meets every split, format and dtype
ROWS_CASES = [(fmt, dtype, ROWS_FUSIONS[(i + split_k) % 4], split_k)
              for i, (fmt, dtype) in enumerate(ROWS_FORMATS) for split_k in (1, 2, 3)]


@pytest.mark.parametrize("fmt, dtype, fusion, split_k", ROWS_CASES)
def test_the_rows_product_matches_the_reference(fmt, dtype, fusion, split_k):
    from floorline.engine.kernels.gemv import GemvConfig, SplitPartials, gemv_reference
    from floorline.engine.kernels.rows import rows_product
    from floorline.engine.quant import quantise

    torch.manual_seed(0)
    # n not a multiple of the block: masked columns; K split into uneven runs of whole tiles
    # (16-bit and fp8: 200 = 128 + 72 in two, or 128 + 72 + nothing in three; int4's groups of
    # 64: 192 = 128 + 64, or three of 64)
    m, n, k = 5, 96, 192 if fmt == "int4" else 200

    def draw(*shape):
        return torch.randn(shape).to(KERNEL_DEVICE)

    def matrix():
        w = (draw(n, k) * 0.05).to(dtype)
        return w if fmt == "bf16" else quantise(w, fmt, group_size=64)
    w = matrix()
    up = matrix() if fusion in ("swiglu", "gelu") else None
    x = draw(m, k) * 3
    norm = torch.rand(k).to(KERNEL_DEVICE, dtype) + 0.5 if fusion == "norm-bias" else None
    bias = draw(n).to(dtype) if fusion == "norm-bias" else None
    accumulate = fusion == "accumulate"
    if accumulate:
        x = x.to(dtype)  # a product into the residual rows takes the 16-bit activations
    out_dtype = torch.float32 if accumulate else dtype
    start = draw(m, n).to(out_dtype)
    theirs = start.clone()
    options = dict(norm=norm, eps=1e-6, up=up, bias=bias, accumulate=accumulate,
                   act="gelu_tanh" if fusion == "gelu" else "silu")
    gemv_reference(x, w, theirs, **options)
    # split: 64 columns (masked) and tiles of 64 a program; unsplit: the default launch
    config = GemvConfig(64, 64, split_k=split_k) if split_k > 1 else None
    partials = SplitPartials()
    for _ in range(2):  # the second launch finds the partials and counts the first left
        mine = start.clone()
        rows_product(x, w, mine, config=config, partials=partials, **options)
        # fp32: IEEE dots; 16-bit: x in two 16-bit parts (about 2^-16), then the output's
        # rounding
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(mine.float(), theirs.float(), rtol=tolerance, atol=tolerance)
    assert all(not t.any() for buffers in partials._buffers.values() for t in buffers)
    # only a K-split of a product that stores, normalises or gates meets in partials
    assert bool(partials._buffers) == (split_k > 1 and not accumulate)


def test_the_rows_product_refuses_a_launch_it_cannot_run():
    from floorline.engine.kernels.gemv import GemvConfig
    from floorline.engine.kernels.rows import rows_product
    from floorline.engine.quant import quantise

    w = torch.randn(32, 128)
    x, out = torch.randn(2, 128), torch.empty(2, 32)
    with pytest.raises(ValueError, match="needs partials"):
        rows_product(x, w, out, config=GemvConfig(128, 64, split_k=2))
    with pytest.raises(ValueError, match="tiles of at least 16"):
        rows_product(x, w, out, config=GemvConfig(8, 64))
    with pytest.raises(ValueError, match="one group of 64 a tile"):
        rows_product(x, quantise(w, "int4", group_size=64), out, config=GemvConfig(32, 128))


@pytest.mark.parametrize("fmt", ["bf16", "int4", "fp8"])
@pytest.mark.parametrize("fusion", ["plain", "norm-bias", "swiglu"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_the_rows_kernel_is_given_only_what_a_gpu_compiler_takes(fmt, fusion, split_k,
                                                                 monkeypatch):
    # The interpreter takes any object for a pointer; on a GPU Triton specialises each argument
    # and refuses anything but tensors and scalars (a quantised weight passed where there was no
    # bias failed every int4 verify step on an H100).
    from floorline.engine.kernels import rows
    from floorline.engine.kernels.gemv import GemvConfig, SplitPartials
    from floorline.engine.quant import quantise

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(args)

    monkeypatch.setattr(rows, "_rows_kernel", Recorder())
    n, k = 64, 128
    w, up = ((torch.randn(n, k) * 0.05).to(torch.bfloat16) for _ in range(2))
    if fmt != "bf16":
        w, up = (quantise(t, fmt, group_size=64) for t in (w, up))
    x, out = torch.randn(3, k), torch.empty(3, n, dtype=torch.bfloat16)
    options = {"plain": {}, "swiglu": {"up": up},
               "norm-bias": {"norm": torch.ones(k, dtype=torch.bfloat16),
                             "bias": torch.zeros(n, dtype=torch.bfloat16)}}[fusion]
    # split, the partials' buffers go in where they meet (plain: an unread stand-in)
    rows.rows_product(x, w, out, config=GemvConfig(64, 64, split_k=split_k),
                      partials=SplitPartials(), **options)
    (args,) = launched
    assert all(isinstance(a, (torch.Tensor, int, float)) for a in args), [type(a) for a in args]


@pytest.mark.parametrize("text, message", [
    ("engine+verify1", "K from 2 to 16"), ("engine+verify17", "K from 2 to 16"),
    ("engine+verifyx", "K from 2 to 16"), ("hf-eager+verify4", "on the engine's paths only"),
    ("engine+verify4+verify4", "repeats an option"), ("engine+verify4+verify8", "repeats"),
    ("engine+verifyK", "K from 2 to 16"),  # the name the option list gives it
])
def test_a_verify_path_names_its_tokens(text, message):
    from floorline.paths import parse_path

    with pytest.raises(FloorlineError, match=message):
        parse_path(text)


def test_a_verify_cell_times_the_verify_step_against_the_one_step_floor(tmp_path):
    import json

    from floorline.paths import parse_path

    assert parse_path("engine-int4+verify8").name == "engine-int4+verify8"
    db = tmp_path / "r.db"
    run_here("sweep", "--db", db, "--models", "tiny-llama", "--ctx", "16", "--paths",
             "engine,engine+verify8", "--steps", "3", "--warmup", "1", "--device", "cpu",
             "--gpu", "h200", check=True)
    cells = {c["path"]: c for c in json.loads(run_here("show", "--db", db, "--json",
                                                       check=True).stdout)}
    one, eight = cells["engine"], cells["engine+verify8"]
    assert one["status"] == eight["status"] == "valid"
    assert eight["details"]["verify_tokens"] == 8 and "verify_tokens" not in one["details"]
    assert eight["floor_ms"] == one["floor_ms"]  # the same weights and cache are read


def test_the_rows_kernel_compiles_for_hopper():
    # The interpreter, where the tests run the kernel, does not type-check as the compiler does
    # (a branch that a constant rules out is still compiled): every format and fusion the verify
    # step launches is compiled for sm_90 with Triton's own ptxas, no GPU needed.
    from conftest import compile_for_hopper

    assert len(compile_for_hopper("engine_rows_sass.py")) == 14  # 9 unsplit, 5 split along K


def test_the_rows_tuner_times_each_candidate_and_keeps_the_fastest(tmp_path, monkeypatch):
    # a fake timer (the CPU has no CUDA graph to replay): each candidate's launches are run and
    # recorded, and a cost per configuration returned; one candidate cannot launch at all
    from triton.runtime.errors import OutOfResources

    from floorline.engine import tuning
    from floorline.engine.kernels.rows import default_config

    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "rotation_copies", lambda nbytes, device: 2)
    launched = []
    monkeypatch.setattr(tuning, "rows_product",
                        lambda x, w, out, *, config, **options: launched.append((x, config)))
    n, k = 96, 512
    configs = tuning.rows_candidates(k)
    fastest, too_big = configs[5], configs[0]
    assert fastest.split_k == 1 and any(c.split_k > 1 for c in configs)

    def timer(run):
        launched.clear()
        run()
        (config,) = {c for _, c in launched}
        assert len(launched) == 2 and launched[0][0].shape == (tuning.ROWS, k)
        if config == too_big:
            raise OutOfResources(300000, 232448, "shared memory")
        return 2 * (1.0 if config == fastest else 2.0 + configs.index(config))

    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    out = torch.empty(3, n, dtype=torch.bfloat16)
    flags = dict(norm=True, up=False, bias=True, accumulate=False)
    assert tuning.GemvTuner("cpu").config(w, out, rows=True, **flags) == default_config(w)
    tuner = tuning.GemvTuner("cpu", timer=timer)
    assert tuner.config(w, out, rows=True, **flags) == fastest
    key = tuner.key(w, out, rows=True, **flags)
    assert key == "cpu|96x512|torch.bfloat16->torch.bfloat16|bias,norm|rows"
    assert tuner.table[key]["us"] == 1.0 and not tuner.seen  # in-step tuning is the GEMV's
    again = tuning.GemvTuner("cpu")  # the table on disk, read back
    assert again.current(key) == fastest
    assert again.config(w, out, rows=True, **flags) == default_config(w)  # the CPU's, untuned
    launched.clear()
    tuning.GemvTuner("cpu", timer=timer).config(w, out, rows=True, **flags)
    assert not launched  # a shape in the table is not timed again


def test_a_shape_no_candidate_can_launch_is_refused_in_one_line(tmp_path, monkeypatch):
    from triton.runtime.errors import OutOfResources

    from floorline.engine import tuning

    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "rotation_copies", lambda nbytes, device: 1)

    def timer(run):
        raise OutOfResources(300000, 232448, "shared memory")

    w = (torch.randn(32, 256) * 0.05).to(torch.bfloat16)
    out = torch.empty(3, 32, dtype=torch.bfloat16)
    with pytest.raises(FloorlineError, match=r"^no launch of the rows product of a 32x256 "
                                             r"torch.bfloat16 matrix fits the cpu's"):
        tuning.GemvTuner("cpu", timer=timer).config(w, out, rows=True, norm=False, up=False,
                                                    bias=False, accumulate=True)


def test_a_rows_tuning_entry_with_tiles_under_the_tensor_cores_is_one_line(tmp_path,
                                                                          monkeypatch):
    import json

    from floorline.engine.tuning import GemvTuner

    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    table = tmp_path / "engine-gemv.json"
    entry = {"block_n": 8, "block_k": 64, "num_warps": 4, "split_k": 2, "num_stages": 3}
    table.write_text(json.dumps({"g|8x64|torch.bfloat16->torch.float32|": entry}))
    assert len(GemvTuner("cpu").table) > 1  # a GEMV may take 8 rows a program
    table.write_text(json.dumps({"g|8x64|torch.bfloat16->torch.float32||rows": entry}))
    with pytest.raises(FloorlineError) as raised:
        GemvTuner("cpu")
    assert str(raised.value) == (
        f"cannot read the GEMV tuning table {table} (entry 'g|8x64|torch.bfloat16->torch.float32"
        "||rows': block_n is 8, not a power of two from 16 to 1024); delete it to tune again")
