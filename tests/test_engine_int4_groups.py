"""int4 in groups of 32 and 64 as well as 128: the group the engine picks for a model and what it
refuses, the GEMV kernel's tuned tiles for the smaller groups (Triton's interpreter on the CPU),
GGUF Q4_0 blocks as int4 of group 32, the floor's bytes per group against plain arithmetic, and
the group an engine-int4 cell records."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import KERNEL_DEVICE

from floorline.engine import Engine, quant
from floorline.engine.check import compare_with_transformers, relative_error
from floorline.engine.kernels.gemv import SplitPartials, gemv, gemv_reference
from floorline.engine.model import EngineUnsupported
from floorline.engine.tuning import candidates
from floorline.engine.weights import int4_group
from floorline.errors import FloorlineError
from floorline.hardware import lookup
from floorline.models import resolve_model
from floorline.traffic import floor

TINY_LLAMA = Path(__file__).parents[1] / "src/floorline/models/configs/tiny-llama.json"


def tiny(tmp_path, hidden, heads, intermediate, kv_heads=1):
    """tiny-llama with other widths (head_dim 32 where the heads divide hidden so)."""
    config = json.loads(TINY_LLAMA.read_text())
    config.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  intermediate_size=intermediate)
    directory = tmp_path / f"tiny-{hidden}-{intermediate}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return resolve_model(str(directory))


@pytest.mark.parametrize("hidden, heads, intermediate, group", [
    (128, 4, 384, 128), (192, 6, 320, 64), (160, 5, 288, 32), (96, 6, 256, 32),
    (128, 8, 320, 64),  # heads x head_dim (8 x 16) divides by 128, intermediate only by 64
])
def test_the_automatic_group_is_the_largest_that_divides_every_width(hidden, heads,
                                                                     intermediate, group):
    config = SimpleNamespace(hidden=hidden, heads=heads, head_dim=hidden // heads,
                             intermediate=intermediate)
    assert int4_group(config) == group
    assert int4_group(config, 32) == 32  # 32 divides every width here


def test_a_model_no_group_divides_is_refused_in_one_line(tmp_path):
    spec = tiny(tmp_path, 80, 5, 144)  # 5 heads of 16
    with pytest.raises(EngineUnsupported) as e:
        Engine(spec, "cpu", 16, weights="int4")
    assert str(e.value) == ("int4 needs matrix widths (80, 144) that are multiples of 32 (its "
                            "groups are 128, 64 or 32 along K)")
    Engine(spec, "cpu", 16, weights="fp8")  # only int4 has groups


def test_a_group_that_does_not_divide_or_is_not_the_engines_is_refused(tmp_path):
    qwen = resolve_model("tiny-qwen2")  # hidden 96, intermediate 256
    with pytest.raises(EngineUnsupported, match=r"^int4 group 64 needs every matrix width "
                                                r"\(96, 256\) to be a multiple of it$"):
        Engine(qwen, "cpu", 16, weights="int4", group_size=64)
    with pytest.raises(EngineUnsupported, match="group size 48: the engine's are 128, 64, 32"):
        Engine(resolve_model("tiny-llama"), "cpu", 16, weights="int4", group_size=48)
    with pytest.raises(FloorlineError, match="a group size is for int4 weights, not fp8"):
        Engine(qwen, "cpu", 16, weights="fp8", group_size=32)


def test_the_engine_runs_and_reports_its_group(tmp_path):
    spec = tiny(tmp_path, 192, 6, 320)
    engine = Engine(spec, "cpu", 16, weights="int4")
    layer = engine.decoder.w.layers[0]
    assert engine.group_size == 64
    assert {w.group_size for w in (layer.wqkv, layer.wo, layer.wgate, layer.wup,
                                   layer.wdown)} == {64}
    assert Engine(spec, "cpu", 16, weights="int4", group_size=32).group_size == 32
    assert Engine(spec, "cpu", 16).group_size is None


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_automatic_groups_decode_like_transformers(tmp_path, backend):
    spec = tiny(tmp_path, 160, 5, 288)  # group 32
    steps = 8 if backend == "reference" else 2  # the interpreter runs each kernel slowly
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    r = compare_with_transformers(spec, device, torch.float32, prompt_len=4, steps=steps,
                                  backend=backend, graph=False, weights="int4")
    assert r.argmax_agree == r.positions == steps + 1
    # the kernels take x as integers scaled per chunk (a rounding of 2^-14), the reference not
    assert max(r.errors) < (1e-4 if backend == "reference" else 5e-4)


# a stored product, a gated one (both meeting in partials when split) and an accumulating one
FUSIONS = [dict(norm=True, bias=True), dict(norm=True, up=True, act="gelu_tanh"),
           dict(bias=True, accumulate=True)]


@pytest.mark.parametrize("group", [32, 64])
def test_every_tuning_tile_of_the_small_groups_matches_the_reference(group):
    g = torch.Generator().manual_seed(group)
    n, k = 24, 1024  # blocks of 16 rows leave a ragged one

    def draw(*shape, scale=1.0):
        return torch.randn(shape, generator=g).to(KERNEL_DEVICE) * scale

    w, up = (quant.quantise_int4(draw(n, k, scale=0.05), group) for _ in range(2))
    x, h = draw(k), draw(n)
    norm, bias = draw(k).bfloat16(), draw(n).bfloat16()
    configs = candidates(k, group)
    # the tables' tiles at this group: whole groups, and threads spread as at group 128
    assert {c.block_k // group for c in configs} == {512 // group, 1024 // group}
    assert any(c.split_k > 1 for c in configs)
    partials = SplitPartials()
    # each tile in one fusion, turning through them (from another start at each group): each
    # fusion meets blocks of 8 and 16 rows, and in the tables as they are both stored and gated
    # meet the split tiles
    for i, config in enumerate(configs):
        fusion = FUSIONS[(i + group // 32) % len(FUSIONS)]
        kwargs = dict(norm=norm if fusion.get("norm") else None, eps=1e-6,
                      up=up if fusion.get("up") else None,
                      bias=bias if fusion.get("bias") else None,
                      accumulate=fusion.get("accumulate", False),
                      act=fusion.get("act", "silu"))
        mine = (h.clone() if kwargs["accumulate"]
                else torch.full((n,), float("nan"), device=KERNEL_DEVICE))
        ref = mine.clone()
        gemv(x, w, mine, config=config, partials=partials, **kwargs)
        gemv_reference(x, w, ref, **kwargs)
        assert relative_error(mine, ref) < 5e-4, (config, fusion)


def test_gguf_q4_0_blocks_are_int4_of_group_32():
    # Q4_0: 32 weights per block, w = d * (q - 8) with an fp16 d: zero point 8, scale d
    g = torch.Generator().manual_seed(3)
    n, k = 8, 128
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).to(torch.float16)
    w = quant.int4_from_integers(q, torch.full((n, k // 32), 8), d, 32)
    expected = (q - 8).float() * d.float().repeat_interleave(32, dim=1)
    assert torch.equal(w.dequantise(), expected)
    w = quant.int4_from_integers(q.to(KERNEL_DEVICE), torch.full((n, k // 32), 8,
                                 device=KERNEL_DEVICE), d.to(KERNEL_DEVICE), 32)
    x = torch.randn(k, generator=g).to(KERNEL_DEVICE)
    mine, ref = (torch.zeros(n, device=KERNEL_DEVICE) for _ in "ab")
    gemv(x, w, mine, config=candidates(k, 32)[0])
    gemv_reference(x, w, ref)
    assert relative_error(mine, ref) < 5e-4


def _linear_shapes(hidden, heads, kv_heads, head_dim, intermediate, layers):
    """(out, in) of each decoder linear, written out from a Llama config."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q),
                 (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    return per_layer * layers


@pytest.mark.parametrize("hidden, heads, intermediate, group", [
    (160, 5, 288, 32), (192, 6, 320, 64), (128, 4, 384, 128)])
def test_the_floor_counts_the_scales_and_zeros_of_the_group_that_runs(tmp_path, hidden, heads,
                                                                      intermediate, group):
    spec = tiny(tmp_path, hidden, heads, intermediate)
    h200 = lookup("h200")
    sixteen = floor(spec, h200, 16, "bf16").weight_bytes
    shapes = _linear_shapes(hidden, heads, 1, 32, intermediate, layers=2)
    # per row and group of K: 4 bits a weight, an fp16 scale and a uint8 zero point
    int4 = sum(o * i // 2 + o * (i // group) * (2 + 1) for o, i in shapes)
    expected = sixteen - sum(2 * o * i for o, i in shapes) + int4
    automatic = floor(spec, h200, 16, "engine-int4")
    assert automatic.weight_format == f"engine-int4-g{group}"
    assert automatic.weight_bytes == expected
    assert floor(spec, h200, 16, f"engine-int4-g{group}").weight_bytes == expected
    # the bytes the engine stores for its linears are the ones the floor counts
    layers = Engine(spec, "cpu", 16, weights="int4").decoder.w.layers
    stored = sum(quant.nbytes(getattr(layer, m)) for layer in layers
                 for m in ("wqkv", "wo", "wgate", "wup", "wdown"))
    assert stored == int4
    # an fp8 head: e4m3 values and an fp32 scale per row of the 1024-row vocabulary
    head = floor(spec, h200, 16, "engine-int4-fp8head")
    assert head.weight_format == f"engine-int4-g{group}-fp8head"
    assert head.weight_bytes == expected - 1024 * hidden * 2 + 1024 * hidden + 1024 * 4


def test_an_engine_int4_cell_records_its_group_and_its_floor_is_the_groups(tmp_path):
    from floorline.paths import REGISTRY

    spec = tiny(tmp_path, 160, 5, 288)
    path = REGISTRY["engine-int4"]
    assert path.weight_format == "engine-int4"  # resolved per model by the floor
    assert floor(spec, lookup("h200"), 8, path.weight_format).weight_format == "engine-int4-g32"
    session = path.open(spec, "cpu", 16, seed=0)
    try:
        session.prefill(8)
        assert session.prefill_details()["group_size"] == 32
    finally:
        session.close()
    session = REGISTRY["engine"].open(spec, "cpu", 16, seed=0)
    try:
        session.prefill(8)
        assert "group_size" not in session.prefill_details()
    finally:
        session.close()
