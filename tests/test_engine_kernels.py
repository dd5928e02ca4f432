"""The engine's Triton kernels against their PyTorch references on random inputs.

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on
tiny shapes. Outputs are poisoned with NaN first, so an element the kernel never writes fails.
"""

import pytest
import torch

from floorline.engine.check import relative_error
from floorline.engine.kernels.attention import (
    attention_scratch,
    decode_attention,
    decode_attention_reference,
)
from floorline.engine.kernels.gemv import GemvConfig, SplitPartials, gemv, gemv_reference
from floorline.engine.tuning import candidates, interpreter_config, tune_in_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 arithmetic lands far under 1e-5; a bf16 output differs by its own rounding (~4e-3).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def poisoned(n, dtype):
    return torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)


def draw(*shape, dtype=torch.float32, generator):
    return torch.randn(shape, generator=generator).to(DEVICE, dtype)


CONFIGS = [GemvConfig(4, 32), GemvConfig(16, 16), GemvConfig(1, 64, num_warps=1)]
F32, BF16 = torch.float32, torch.bfloat16
# shapes even, ragged and tiny: every configuration meets each dtype on the tiny shape and each
# larger shape once, the dtypes alternating so that each meets each shape (tiles of one row and
# 64 columns have no ragged row block and a ragged K in both, so take only one)
GEMV_FUSION_CASES = [(config, 7, 33, dtype) for config in CONFIGS for dtype in (F32, BF16)]
GEMV_FUSION_CASES += [(CONFIGS[0], 48, 96, F32), (CONFIGS[1], 48, 96, BF16),
                      (CONFIGS[0], 22, 100, BF16), (CONFIGS[1], 22, 100, F32),
                      (CONFIGS[2], 22, 100, BF16)]


@pytest.mark.parametrize("config, n, k, dtype", GEMV_FUSION_CASES, ids=str)
def test_gemv_fusions_match_the_reference(config, n, k, dtype):
    g = torch.Generator().manual_seed(n * k)
    x = draw(k, generator=g)
    w, up = draw(n, k, dtype=dtype, generator=g), draw(n, k, dtype=dtype, generator=g)
    norm, bias = draw(k, dtype=dtype, generator=g), draw(n, dtype=dtype, generator=g)
    cases = [dict(), dict(norm=norm, eps=1e-6), dict(norm=norm, eps=1e-6, bias=bias),
             dict(norm=norm, eps=1e-6, up=up), dict(norm=norm, eps=1e-6, up=up, act="gelu_tanh")]
    for kwargs in cases:
        mine, ref = poisoned(n, dtype), poisoned(n, dtype)
        gemv(x, w, mine, config=config, **kwargs)
        gemv_reference(x, w, ref, **kwargs)
        assert relative_error(mine, ref) < TOLERANCE[dtype], kwargs.keys()


@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_accumulates_into_the_residual_with_k_splits(split_k, dtype):
    # as the step runs o and down: 16-bit x and W added into the fp32 residual stream;
    # K = 112 is 7 blocks of 16 (a split of 3 leaves a ragged last split), K = 128 with a
    # split of 4 is the even case
    g = torch.Generator().manual_seed(split_k)
    n, k = 40, 128 if split_k == 4 else 112
    x, w, b = (draw(k, dtype=dtype, generator=g), draw(n, k, dtype=dtype, generator=g),
               draw(n, dtype=dtype, generator=g))
    h = draw(n, generator=g)
    expected = h + w.double() @ x.double() + b.double()
    gemv(x, w, h, config=GemvConfig(8, 16, split_k=split_k), bias=b, accumulate=True)
    assert relative_error(h, expected) < 1e-5


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_splits_meet_in_partials_for_every_fusion(split_k, dtype):
    # the splits of a product that stores, normalises or gates: the last split to arrive per
    # row block finishes it; twice, as graph replays do, the second launch finding the partials
    # as the first left them. N = 18 leaves a ragged row block, K = 112 a ragged last split.
    g = torch.Generator().manual_seed(10 + split_k)
    n, k = 18, 112
    x = draw(k, generator=g)
    w, up = draw(n, k, dtype=dtype, generator=g), draw(n, k, dtype=dtype, generator=g)
    norm, bias = draw(k, dtype=dtype, generator=g), draw(n, dtype=dtype, generator=g)
    partials = SplitPartials()
    config = GemvConfig(16, 16, split_k=split_k)
    for kwargs in [dict(), dict(norm=norm, eps=1e-6, bias=bias), dict(norm=norm, eps=1e-6, up=up),
                   dict(norm=norm, eps=1e-6, up=up, act="gelu_tanh")]:
        for _ in range(2):
            mine, ref = poisoned(n, dtype), poisoned(n, dtype)
            gemv(x, w, mine, config=config, partials=partials, **kwargs)
            gemv_reference(x, w, ref, **kwargs)
            assert relative_error(mine, ref) < TOLERANCE[dtype], kwargs.keys()
    sums, counts = partials.get(n, 2, DEVICE)
    assert not sums.any() and not counts.any()


def test_gemv_refuses_what_it_cannot_compute():
    x, w = torch.randn(64, device=DEVICE), torch.randn(8, 64, device=DEVICE)
    out = torch.empty(8, device=DEVICE)
    with pytest.raises(ValueError, match="needs partials"):
        gemv(x, w, out, config=GemvConfig(4, 16, split_k=2))
    with pytest.raises(ValueError, match="needs partials"):
        gemv(x, w, out, config=GemvConfig(4, 16, split_k=2), norm=torch.ones(64),
             accumulate=True)
    with pytest.raises(ValueError, match="fp32 residual"):
        gemv(x.bfloat16(), w.bfloat16(), out.bfloat16(), config=GemvConfig(4, 16),
             accumulate=True)


def test_tuning_candidates_fit_their_shape():
    for k in [3584, 18944, 96]:
        configs = candidates(k)
        assert any(c.split_k == 1 for c in configs)
        for c in configs:
            assert c.block_k <= max(16, 1 << (k - 1).bit_length())
            assert c.split_k * c.block_k <= k or c.split_k == 1
    assert any(c.split_k > 1 for c in candidates(18944))
    assert interpreter_config(96).block_k == 128


class FakeStep:
    """A step whose time is 1 ms plus each shape's cost for the configuration in force; `lucky`
    configurations time fast at their first (screening) timing only, as noise would have it."""

    def __init__(self, cost, lucky=()):
        self.cost, self.lucky = cost, set(lucky)
        self.state = {key: GemvConfig(16, 512) for key, _ in cost}
        self.timings = 0

    def apply(self, key, config):
        self.state[key] = config

    def time_step(self):
        self.timings += 1
        luck = [(k, c) for k, c in self.state.items() if (k, c) in self.lucky]
        self.lucky -= set(luck)
        return 1.0 + sum(self.cost[k, c] for k, c in self.state.items()) - 0.1 * len(luck)


def test_in_step_tuning_takes_a_faster_configuration_only_when_confirmed():
    a, b, c = GemvConfig(16, 512), GemvConfig(8, 512), GemvConfig(16, 512, split_k=2)
    # x: b saves 5% of the step; y: b saves 0.1% (under the 0.3% asked) and c is only lucky
    cost = {("x", a): 0.0, ("x", b): -0.05, ("x", c): 0.01,
            ("y", a): 0.0, ("y", b): -0.001, ("y", c): 0.02}
    step = FakeStep(cost, lucky=[("y", c)])
    chosen = tune_in_step(["x", "y"], lambda key: [a, b, c], step.state.__getitem__,
                          step.apply, step.time_step, min_gain=0.003, rounds=3)
    assert [r["chosen"] for r in chosen] == [b, a]
    assert chosen[0]["ratio"] == pytest.approx(0.95)
    assert chosen[1]["ratio"] == pytest.approx(0.97 / 0.95)  # the lucky one, confirmed slower
    assert step.state == {"x": b, "y": a}  # what was chosen is what stays in force
    assert chosen[0]["screened_ms"] == {a: 1.0, b: 0.95, c: 1.01}
    # per shape: the incumbent and two candidates screened once, then 3 rounds of 2
    assert step.timings == 2 * (3 + 3 * 2)


def test_in_step_tuning_keeps_the_incumbent_when_it_is_fastest():
    a, b = GemvConfig(16, 512), GemvConfig(8, 512)
    step = FakeStep({("x", a): 0.0, ("x", b): 0.02})
    chosen = tune_in_step(["x"], lambda key: [b, a], step.state.__getitem__, step.apply,
                          step.time_step)
    assert chosen[0]["chosen"] == a and chosen[0]["ratio"] is None
    assert step.state == {"x": a} and step.timings == 2


def attention_case(dtype, pos, window, splits, seed, heads=6, kv_heads=2, rotary=None,
                   qk_norm=False):
    g = torch.Generator().manual_seed(seed)
    d, capacity = 16, 40
    qkv = draw((heads + 2 * kv_heads) * d, dtype=dtype, generator=g)
    caches = [draw(kv_heads, capacity, d, dtype=dtype, generator=g) for _ in "kv"]
    angles = draw(capacity, (rotary or d) // 2, generator=g)
    tables = (angles.cos(), angles.sin())
    extra = dict(rotary=rotary)
    if qk_norm:  # per-head RMSNorm weights of q and k (Qwen3, Gemma 3)
        extra.update(q_norm=draw(d, generator=g), k_norm=draw(d, generator=g), eps=1e-6)
    position = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    results = []
    for kernel, scratch in ((decode_attention, attention_scratch(heads, d, splits, DEVICE)),
                            (decode_attention_reference, None)):
        k, v = (c.clone() for c in caches)
        out = poisoned(heads * d, dtype)
        kernel(qkv.clone(), k, v, *tables, position, out, scale=d ** -0.5, window=window,
               scratch=scratch, block_t=16, **extra)
        results.append((out, k, v))
    return results


# first token, short, several blocks, last slot; each with and without a window, the dtypes
# turning so that each meets every position and both windows
@pytest.mark.parametrize("pos, window, dtype", [
    (0, None, F32), (0, 6, BF16), (5, None, BF16), (5, 6, F32), (17, None, F32), (17, 6, BF16),
    (39, None, BF16), (39, 6, F32)])
def test_decode_attention_matches_the_reference(pos, window, dtype):
    (out, k, v), (ref_out, ref_k, ref_v) = attention_case(dtype, pos, window, splits=4, seed=pos)
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    # the new token's k (rotated) and v land in the cache at pos, nothing else changes
    assert relative_error(k, ref_k) < TOLERANCE[dtype] / 4
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (40, 2)])  # no GQA; a group above 16
@pytest.mark.parametrize("window", [None, 30])  # a window over several chunks
def test_decode_attention_group_sizes(heads, kv_heads, window):
    (out, k, _), (ref, ref_k, _) = attention_case(torch.float32, 37, window, splits=4, seed=2,
                                                  heads=heads, kv_heads=kv_heads)
    assert relative_error(out, ref) < 1e-5 and relative_error(k, ref_k) < 1e-6


def test_decode_attention_with_more_splits_than_blocks():
    # 32 chunks over 12 tokens: most programs find an empty span and must not count
    (out, _, _), (ref, _, _) = attention_case(torch.float32, 11, None, splits=32, seed=1)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("rotary, qk_norm", [(8, False), (12, False), (16, True), (12, True)])
def test_decode_attention_with_qk_norms_and_partial_rotary(rotary, qk_norm):
    # half or 3/4 of each head turned (Phi-3), the rest as it is; q and k normalised per head
    (out, k, _), (ref, ref_k, _) = attention_case(torch.float32, 21, None, splits=4, seed=3,
                                                  rotary=rotary, qk_norm=qk_norm)
    assert relative_error(out, ref) < 1e-5 and relative_error(k, ref_k) < 1e-6


@pytest.mark.parametrize("n", [64, 100])  # a power of two, and one the block overhangs
def test_add_norm_matches_the_reference(n):
    from floorline.engine.kernels.norm import add_norm, add_norm_reference

    g = torch.Generator().manual_seed(n)
    x, w, h = draw(n, generator=g), draw(n, generator=g), draw(n, generator=g)
    mine, ref = h.clone(), h.clone()
    add_norm(x, w, mine, eps=1e-6)
    add_norm_reference(x, w, ref, eps=1e-6)
    expected = h.double() + x.double() / x.double().pow(2).mean().add(1e-6).sqrt() * w.double()
    assert relative_error(mine, ref) < 1e-6 and relative_error(ref, expected) < 1e-6


@pytest.mark.parametrize("n, scale", [(48, None), (1100, None), (1100, 62.0)])
def test_embed_writes_the_tokens_row_in_fp32(n, scale):
    from floorline.engine.kernels.tokens import embed, embed_reference

    g = torch.Generator().manual_seed(n)
    table = draw(5, n, dtype=torch.bfloat16, generator=g)
    token = torch.tensor([3], device=DEVICE)
    mine, ref = poisoned(n, torch.float32), poisoned(n, torch.float32)
    embed(table, token, mine, scale=scale)
    embed_reference(table, token, ref, scale=scale)
    assert torch.equal(mine, ref)
    assert torch.equal(mine, table[3].float() * (scale or 1.0))


def test_argmax_takes_the_first_largest_across_programs_and_launches():
    from floorline.engine.kernels.tokens import argmax, argmax_scratch

    n, block = 1000, 64  # 16 programs, the last one ragged
    scratch = argmax_scratch(n, DEVICE, block=block)
    token = torch.full((1,), -1, dtype=torch.long, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    for case in range(4):  # the counter must be back at zero after every launch
        x = draw(n, generator=g)
        if case == 1:  # a tie between programs: the first index wins
            x[[700, 130, 999]] = 9.0
        if case == 2:  # the largest in the ragged last program
            x[990] = 9.0
        if case == 3:  # NaN counts as the largest, as in torch.argmax
            x[517] = float("nan")
        argmax(x, token, scratch)
        assert token.item() == torch.argmax(x).item(), case
        assert scratch.count.item() == 0
    order = torch.randperm(n, generator=g).to(DEVICE)
    argmax(x, token, scratch, index=order)
    assert token.item() == order[517].item()
    with pytest.raises(ValueError, match="not for 2000 values"):
        argmax(torch.zeros(2000, device=DEVICE), token, scratch)
