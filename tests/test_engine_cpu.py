"""The CPU's fast step (floorline.engine.cpu) against the reference it stands beside: the same
tokens and logits in float32 for every family's features and cache format, its bf16 products
within bf16's rounding of the reference's, and oneDNN's switch left as it was."""

import pytest
import torch
import torch.backends.mkldnn as onednn
from tests.test_engine_families import spec as family_spec

from floorline.engine import Engine
from floorline.engine.cpu import REFINED, CpuOps, linear
from floorline.engine.ops import ReferenceOps
from floorline.models import resolve_model

PROMPT = [3, 17, 42, 5, 99, 7, 64, 12, 8, 30, 21, 2]


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
def test_a_16_bit_row_is_the_fp32_product_rounded_once(dtype):
    """x and W as the step holds them, summed in fp32: within one rounding of the exact product,
    and oneDNN's switch as it was, on or off."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=g).to(dtype)
    x = torch.randn(576, generator=g).to(dtype)
    exact = w.float() @ x.float()
    before = onednn.enabled
    try:
        for enabled in (True, False):
            onednn.enabled = enabled
            y = linear(x, w)
            assert onednn.enabled is enabled
            assert y.dtype == dtype
            assert torch.allclose(y.float(), exact, rtol=2 * torch.finfo(dtype).eps, atol=1e-3)
    finally:
        onednn.enabled = before


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
