"""The CPU's fast step (floorline.engine.cpu) against the reference it stands beside: the same
tokens and logits in float32 for every family's features and cache format, its bf16 products
within bf16's rounding of the reference's by every route (floorline's own kernel among them),
and oneDNN's switch left as it was."""

import re
import time

import pytest
import torch
import torch.backends.mkldnn as onednn
from tests.test_engine_families import spec as family_spec

from floorline.engine import Engine, cpu_kernel, cpu_products, runtime
from floorline.engine.cpu import REFINED, CpuOps
from floorline.engine.cpu_products import (
    KERNEL,
    NATIVE,
    WIDENED,
    ProductPlan,
    linear,
    plan_products,
)
from floorline.engine.ops import ReferenceOps
from floorline.models import resolve_model

PROMPT = [3, 17, 42, 5, 99, 7, 64, 12, 8, 30, 21, 2]
# floorline's AVX2 kernel, where this machine can build it (an x86-64 processor with AVX2 and a
# C compiler: CI's machines and the GPU machine have both)
BUILT = cpu_kernel.kernel()
needs_kernel = pytest.mark.skipif(isinstance(BUILT, str), reason=f"no CPU kernel: {BUILT}")


def decode(spec, backend, steps, **formats):
    """Every step's logits and tokens after PROMPT, on `backend`."""
    e = Engine(spec, "cpu", len(PROMPT) + steps + 1, dtype=torch.float32, backend=backend,
               seed=1, **formats)
    e.prefill(torch.tensor(PROMPT))
    logits, tokens = [], []
    for _ in range(steps):
        e.step()
        logits.append(e.logits.clone())
        tokens.append(e.token.item())
    return torch.stack(logits), tokens


@pytest.mark.parametrize("name, formats", [
    ("qwen3", {}),  # q/k norms
    ("gemma3", {}),  # sliding windows crossed (window 24), post-norms, GeGLU, soft cap
    ("phi3-longrope", {}),  # partial rotary, LongRoPE's long factors from position 40
    ("gemma3", {"kv": "fp8"}),
    ("qwen3", {"weights": "int4", "kv": "fp8"}),
])
def test_cpu_step_decodes_as_the_reference_does(name, formats):
    steps = 40
    ours, our_tokens = decode(family_spec(name), "cpu", steps, **formats)
    theirs, their_tokens = decode(family_spec(name), "reference", steps, **formats)
    assert our_tokens == their_tokens
    error = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item()
    assert error < 1e-5, error


def test_cpu_step_with_a_qkv_bias_and_its_verify_step():
    """Qwen2's biases; a verify step of 4 (several rows: the products oneDNN chooses) gives the
    logits four single steps give."""
    spec = resolve_model("tiny-qwen2")
    single, _ = decode(spec, "cpu", 4)
    e = Engine(spec, "cpu", 64, dtype=torch.float32, backend="cpu", seed=1)
    e.prefill(torch.tensor(PROMPT))
    first = e.token.item()
    reference, tokens = decode(spec, "reference", 4)
    assert torch.allclose(single, reference, rtol=1e-5, atol=1e-5)
    rows = e.verify([*tokens[:3]])
    assert e.token.item() == first
    assert torch.allclose(rows.logits[:4], single, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [None, 2, 16])  # one vector; ATen's GEMV; oneDNN's GEMM
def test_a_16_bit_product_is_the_fp32_product_rounded_once_by_either_route(dtype, rows):
    """x and W as the step holds them, summed in fp32, as stored, widened or (up to two rows) by
    floorline's kernel: within one rounding of the exact product, and oneDNN's switch as it was,
    on or off."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=g).to(dtype)
    x = torch.randn(*([rows] if rows else []), 576, generator=g).to(dtype)
    exact = x.float() @ w.float().T
    before = onednn.enabled
    try:
        for enabled in (True, False):
            onednn.enabled = enabled
            plans = [ProductPlan(), ProductPlan(WIDENED, WIDENED)]
            if rows != 16 and not isinstance(BUILT, str):
                plans.append(ProductPlan(KERNEL, NATIVE))
            for plan in plans:
                y = linear(x, w, plan)
                assert onednn.enabled is enabled
                assert y.dtype == dtype
                assert torch.allclose(y.float(), exact, rtol=2 * torch.finfo(dtype).eps,
                                      atol=1e-3)
    finally:
        onednn.enabled = before


def timed_routes(monkeypatch, cost, kernel="no kernel here"):
    """plan_products' trials on a host whose routes take cost[route, rows] s a product; the
    kernel built where `kernel` is None, else that the reason it could not be."""
    def timed(x, w, plan):
        time.sleep(cost[plan.route(x), 1 if x.dim() == 1 else x.shape[0]])
    monkeypatch.setattr(cpu_products, "linear", timed)
    monkeypatch.setattr(cpu_products, "_plans", {})
    monkeypatch.setattr(cpu_kernel, "kernel",
                        lambda: object.__new__(cpu_kernel.Kernel) if kernel is None else kernel)
    weights = Engine(resolve_model("tiny-llama"), "cpu", 16, backend="reference").decoder.w
    return plan_products(weights), weights


def test_each_regime_takes_the_route_its_trial_found_clearly_faster(monkeypatch):
    """A host where widening is slow for one row and fast for many (as where the processor has
    no bf16 dot products): the trial picks each regime's route, and widens only past WIDEN_BY."""
    cost = {(NATIVE, 1): 2e-4, (WIDENED, 1): 4e-4, (NATIVE, 64): 4e-3, (WIDENED, 64): 1e-3}
    plan, weights = timed_routes(monkeypatch, cost)
    assert (plan.few, plan.many) == (NATIVE, WIDENED)
    assert plan.trials["many"][WIDENED] < plan.trials["many"][NATIVE] / cpu_products.WIDEN_BY
    assert plan_products(weights) is plan  # timed once a process
    # the kernel could not be built: the line says why, after the routes
    assert plan.describe(torch.bfloat16, trials=False) == (
        "1-2 rows: bf16 as stored; more rows: bf16 widened to fp32; floorline's AVX2 kernel: "
        "no kernel here")
    cost[WIDENED, 64] = 3.6e-3  # faster, but within the margin: stays as stored
    monkeypatch.setattr(cpu_products, "_plans", {})
    assert plan_products(weights).many == NATIVE


@pytest.mark.parametrize("kernel_s, chosen", [(1e-3, KERNEL), (2e-3, NATIVE)])
def test_a_step_takes_the_kernel_where_its_trial_found_it_clearly_faster(monkeypatch, kernel_s,
                                                                        chosen):
    """As where PyTorch's bf16 product is bound by converting its weights: the kernel at half
    the time is chosen for a step's rows, at the same time (inside KERNEL_BY, with room for a
    busy host's late wake-ups) it is not; more rows never try it."""
    cost = {(NATIVE, 1): 2e-3, (WIDENED, 1): 4e-3, (KERNEL, 1): kernel_s,
            (NATIVE, 64): 1e-3, (WIDENED, 64): 4e-3}
    plan, _ = timed_routes(monkeypatch, cost, kernel=None)
    assert (plan.few, plan.many) == (chosen, NATIVE)
    assert set(plan.trials["few"]) == {NATIVE, WIDENED, KERNEL}
    assert set(plan.trials["many"]) == {NATIVE, WIDENED}
    said = plan.describe(torch.bfloat16)
    assert said.startswith("1-2 rows: bf16 " + ("by floorline's AVX2 kernel (" if chosen == KERNEL
                                                 else "as stored ("))
    assert " ms kernel in its trial); more rows: bf16 as stored (" in said
    assert "floorline's AVX2 kernel:" not in said


def test_a_step_is_timed_on_every_matrix_it_reads_and_many_rows_on_the_first(monkeypatch):
    """The few-row trial reads every layer's matrices and the head, as a step does (a smaller
    sample stays in cache); the many-row trial the first layers' up to TRIAL_BYTES."""
    seen = {1: [], 64: []}

    def timed(x, w, plan):
        seen[1 if x.dim() == 1 else x.shape[0]].append(w)
    monkeypatch.setattr(cpu_products, "linear", timed)
    monkeypatch.setattr(cpu_products, "_plans", {})
    monkeypatch.setattr(cpu_products, "TRIAL_BYTES", 1)  # the first matrix alone
    weights = Engine(resolve_model("tiny-llama"), "cpu", 16, backend="reference").decoder.w
    plan_products(weights)
    step = [w for layer in weights.layers
            for w in (layer.wqkv, layer.wo, layer.wgate, layer.wup, layer.wdown)]
    step.append(weights.head)
    routes = 3 if not isinstance(cpu_kernel.kernel(), str) else 2
    passes = (cpu_products.TRIAL_ROUNDS + 1) * routes
    assert [tuple(w.shape) for w in seen[1]] == [tuple(w.shape) for w in step] * passes
    assert all(a is b for a, b in zip(seen[1], step))
    assert [tuple(w.shape) for w in seen[64]] == [tuple(step[0].shape)] * (
        (cpu_products.TRIAL_ROUNDS + 1) * 2)


@needs_kernel
def test_the_kernel_is_exact_where_the_sums_are_and_refuses_what_it_cannot_multiply():
    """Small integers sum exactly in fp32 in any order: the kernel's outputs are then the exact
    products to the bit, for both types, odd row counts and widths with a tail past the blocks
    of 16 it converts at once. More rows than it takes, a strided matrix or mixed types: one
    error naming them."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        for n, k in ((1, 16), (7, 45), (33, 576), (130, 1547)):
            w = torch.randint(-8, 8, (n, k), generator=g).to(dtype)
            for shape in ((k,), (1, k), (2, k)):
                x = torch.randint(-8, 8, shape, generator=g).to(dtype)
                y = BUILT.product(x, w)
                assert y.dtype == dtype and y.shape == (*shape[:-1], n)
                assert torch.equal(y, (x.float() @ w.float().T).to(dtype))
    w = torch.ones(8, 32, dtype=torch.bfloat16)
    for x, m in ((torch.ones(3, 32, dtype=torch.bfloat16), w), (torch.ones(32), w),
                 (torch.ones(16, dtype=torch.bfloat16), w.T.contiguous().T[:, :16])):
        with pytest.raises(ValueError, match="the CPU kernel multiplies 1-2 rows"):
            BUILT.product(x, m)


@pytest.mark.parametrize("cc, why", [("no-such-compiler", "no C compiler (no-such-compiler; set "
                                                         "CC to one)"),
                                     ("false", "false could not build it: no message")])
def test_a_kernel_that_cannot_be_built_says_why(monkeypatch, tmp_path, cc, why):
    """No compiler, or one that fails: kernel() is the reason in one line, and nothing half-built
    is left in the cache to load later."""
    if isinstance(BUILT, str) and "compiler" not in BUILT:
        pytest.skip(f"this machine cannot build it whatever the compiler: {BUILT}")
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("FLOORLINE_CACHE", str(tmp_path))
    cpu_kernel.kernel.cache_clear()
    try:
        assert cpu_kernel.kernel() == why
    finally:
        cpu_kernel.kernel.cache_clear()
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("route", [WIDENED, pytest.param(KERNEL, marks=needs_kernel)])
def test_a_step_by_another_route_decodes_as_the_stored_one(monkeypatch, route):
    """bf16 weights, every product widened, or a step's products through floorline's kernel:
    the prefill's logits and the steps' tokens are the as-stored step's, within the order of
    the fp32 sums."""
    spec = resolve_model("tiny-llama")

    def run(plan):
        monkeypatch.setattr(runtime, "plan_products", lambda weights: plan)
        e = Engine(spec, "cpu", 64, seed=1)
        first = e.prefill(torch.tensor(PROMPT)).float()
        tokens = []
        for _ in range(12):
            e.step()
            tokens.append(e.token.item())
        return first, tokens
    other = ProductPlan(WIDENED, WIDENED) if route == WIDENED else ProductPlan(KERNEL, NATIVE)
    stored, theirs = run(ProductPlan()), run(other)
    assert stored[1] == theirs[1]
    assert torch.allclose(stored[0], theirs[0], rtol=0.02, atol=0.02)


def test_cpu_ops_are_the_default_on_the_cpu_and_the_reference_stays():
    spec = resolve_model("tiny-llama")
    assert isinstance(Engine(spec, "cpu", 16).ops, CpuOps)
    reference = Engine(spec, "cpu", 16, backend="reference").ops
    assert type(reference) is ReferenceOps and reference.name == "reference"


def test_the_logits_leaders_are_the_fp32_products():
    """A bf16 head into fp32 logits: the REFINED largest as the reference computes them (fp32 x,
    fp32 sums), the rest within bf16's rounding; a near tie below that rounding is decided as
    the reference decides it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(576, generator=g)
    w = (torch.randn(4096, 576, generator=g) * 0.05).bfloat16()
    w[0] = (x / x.norm()).bfloat16()  # rows 0 and 1 lead the rest by far
    w[1] = w[0]
    j = x.abs().argmax()
    w[1, j] = w[0, j].float() * (1 + 2 ** -7)  # row 1 ahead by less than bf16's rounding
    out, reference = torch.empty(4096), torch.empty(4096)
    CpuOps().gemv(x, w, out)
    ReferenceOps().gemv(x, w, reference)
    top = reference.topk(REFINED).indices
    assert torch.allclose(out[top], reference[top], rtol=1e-6)
    assert (out - reference).abs().max() < 2 ** -7 * reference.abs().max()
    assert out.argmax() == reference.argmax() == 1
    assert linear(x.bfloat16(), w).argmax() == 0  # every logit rounded: a tie, row 0 taken


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_steps_rotation_is_the_references_to_the_bit(dtype):
    from floorline.engine.kernels.attention import rotated_heads

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim = 6, 2, 64
    qkv = (torch.randn((heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    cos, sin = torch.randn(40, head_dim // 2, generator=g), torch.randn(40, head_dim // 2,
                                                                        generator=g)
    ops = CpuOps()
    options = {"q_norm": None, "k_norm": None, "eps": 0.0, "rotary": None}
    for p in (0, 7, 39, 7):
        mine = ops._rotated(qkv, heads, kv_heads, head_dim, cos, sin, p, **options)
        theirs = rotated_heads(qkv, heads, kv_heads, head_dim, cos[p], sin[p], **options)
        assert torch.equal(mine, theirs)


@needs_kernel
@pytest.mark.parametrize("group", [32, 64])
def test_int4_steps_as_stored_through_the_kernel_as_the_reference(monkeypatch, group):
    """The engine's own int4 layout (rows interleaved by four, words strided through a group)
    read by the CPU kernel: float32 logits within the order of the sums, the same tokens."""
    monkeypatch.setattr(runtime, "plan_products", lambda weights: ProductPlan(blocks=KERNEL))
    spec = family_spec("qwen3")
    ours, our_tokens = decode(spec, "cpu", 12, weights="int4", group_size=group)
    theirs, their_tokens = decode(spec, "reference", 12, weights="int4", group_size=group)
    assert our_tokens == their_tokens
    error = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item()
    assert error < 1e-5, error


def test_a_quantised_models_trial_times_its_blocks_both_ways():
    """A quantised model's one-row products timed from their fp32 form and (where it can be
    built) as stored by the kernel; the route the faster by KERNEL_BY, said in its line."""
    cpu_products._plans.clear()
    e = Engine(resolve_model("tiny-llama"), "cpu", 16, weights="int4", group_size=32)
    plan = e.ops.plan
    t = plan.trials["blocks"]
    assert set(t) == ({NATIVE} if isinstance(BUILT, str) else {NATIVE, KERNEL})
    assert plan.blocks == (KERNEL if KERNEL in t and t[KERNEL] * cpu_products.KERNEL_BY
                           < t[NATIVE] else NATIVE)
    said = plan.describe(torch.bfloat16)
    assert re.search(r"quantised, 1 row: (as stored, by floorline's AVX2 kernel|from their fp32 "
                     r"form) \([\d.]+ ms fp32 form(, [\d.]+ ms kernel)? in its trial\)", said)
