"""The engine against transformers' own implementation of the same config and weights.

Both decode the same tokens (transformers' greedy choices, fed to the engine too), so logits can
be compared at every step even where bf16 near-ties would make free-running sequences part. In
float32, the engine's argmax agreeing with transformers' at every step is the same as the two
greedy sequences being equal. In bf16 the band is transformers' own: both are compared with a
float32 copy of transformers' model, and the engine's error should not exceed transformers'
bf16 error by much.

With int4 or fp8 weights (or an fp8 head), each quantised matrix is made once and transformers
runs its dequantised copy (in the run's dtype, and in float32 for the reference), so both sides
compute the same math and the same bands apply. The quantisation error itself, the engine
against transformers on the original 16-bit weights, is reported beside it (quant_vs_16bit).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from floorline.engine.model import DecoderConfig
from floorline.engine.quant import quantise
from floorline.engine.runtime import Engine
from floorline.engine.weights import from_named, int4_group
from floorline.models import build_model, cache_keyword


@dataclass
class Comparison:
    model: str
    dtype: str
    backend: str
    graph: bool
    steps: int
    # Relative L2 error of the logits, engine vs transformers in the same dtype, per position
    # (prefill's last position first).
    errors: list[float] = field(default_factory=list)
    argmax_agree: int = 0  # positions where both pick the same token
    # bf16 only: each against transformers in float32.
    engine_vs_fp32: list[float] = field(default_factory=list)
    hf_vs_fp32: list[float] = field(default_factory=list)
    weights: str = "bf16"
    head: str = "bf16"
    # Quantised runs: the engine against transformers on the unquantised weights.
    quant_vs_16bit: list[float] = field(default_factory=list)
    quant_argmax_agree: int = 0

    @property
    def positions(self) -> int:
        return len(self.errors)

    def summary(self) -> dict:
        out = {"model": self.model, "dtype": self.dtype, "backend": self.backend,
               "weights": self.weights, "head": self.head,
               "graph": self.graph, "positions": self.positions,
               "max_rel_err": max(self.errors), "median_rel_err": _median(self.errors),
               "argmax_agree": self.argmax_agree}
        if self.engine_vs_fp32:
            out["engine_vs_fp32_median"] = _median(self.engine_vs_fp32)
            out["hf_vs_fp32_median"] = _median(self.hf_vs_fp32)
        if self.quant_vs_16bit:
            out["quant_vs_16bit_median"] = _median(self.quant_vs_16bit)
            out["quant_argmax_agree"] = self.quant_argmax_agree
        return out


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64, on the CPU (a and b may live on different devices)."""
    a, b = a.detach().cpu().double().flatten(), b.detach().cpu().double().flatten()
    return ((a - b).norm() / b.norm()).item()


def perturb_(hf_model, seed: int) -> None:
    """Norm weights and biases away from transformers' ones and zeros, so that a kernel that
    ignored or misindexed them would show."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in hf_model.named_parameters():
        if name.endswith("norm.weight") or name.endswith(".bias"):
            noise = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
            p.add_(0.1 * noise)


def quantise_in_place(hf, reference, weights: str, head: str, group_size: int | None) -> dict:
    """Each decoder linear (and the LM head, for an fp8 head) quantised once; transformers'
    model and its float32 reference get the dequantised matrices. Returns {prefix: weight}."""
    made = {}
    head_module = hf.get_output_embeddings()
    fp32 = dict(reference.named_modules()) if reference is not None else {}
    for name, module in hf.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        fmt = head if module is head_module else weights
        if fmt == "bf16":
            continue
        q = quantise(module.weight.data.float(), fmt, group_size)
        module.weight.data.copy_(q.dequantise(module.weight.dtype))
        if name in fp32:
            fp32[name].weight.data.copy_(q.dequantise(torch.float32))
        made[name] = q
    return made


HF_CHUNK = 2048  # prompt tokens per transformers forward in the comparison


def compare_with_transformers(model_spec, device: str, dtype: torch.dtype, *, prompt_len: int = 16,
                              steps: int = 64, seed: int = 0, backend: str | None = None,
                              graph: bool | None = None, weights: str = "bf16",
                              head: str = "bf16", group_size: int | None = None) -> Comparison:
    from transformers import DynamicCache

    device = str(device)
    graph = device.startswith("cuda") if graph is None else graph
    hf = build_model(model_spec.without_weights(), device, dtype, seed)
    perturb_(hf, seed)
    quantised = weights != "bf16" or head != "bf16"
    if head != "bf16" and hf.get_output_embeddings().weight is hf.get_input_embeddings().weight:
        raise ValueError("an fp8 head is compared on untied models only (the input table "
                         "stays 16-bit)")
    original = copy.deepcopy(hf) if quantised else None
    reference = copy.deepcopy(hf).float() if dtype != torch.float32 else None
    config = DecoderConfig.from_hf(model_spec.config)
    if weights == "int4":  # None: the engine's own choice
        group_size = int4_group(config, group_size)
    made = quantise_in_place(hf, reference, weights, head, group_size)
    params = dict(hf.named_parameters())
    decoder_weights = from_named(config, params.__getitem__, device, dtype,
                                 linear=made.__getitem__ if weights != "bf16" else None)
    if head != "bf16":
        decoder_weights.head = made["lm_head"]
    engine = Engine(model_spec, device, prompt_len + steps + 1, dtype=dtype, backend=backend,
                    decoder_weights=decoder_weights)
    result = Comparison(model_spec.name, str(dtype).removeprefix("torch."), engine.ops.name, graph,
                        steps, weights=weights, head=head)
    prompt = torch.randint(engine.config.vocab, (1, prompt_len),
                           generator=torch.Generator().manual_seed(seed)).to(device)
    caches = {id(m): DynamicCache(config=m.config) for m in (hf, reference, original)
              if m is not None}

    def hf_logits(hf_model, tokens, start):
        # a long prompt in pieces: attention with a mask can take transformers' math path,
        # whose scores for a whole 32k prompt would not fit on the GPU
        for at in range(0, tokens.shape[1], HF_CHUNK):
            piece = tokens[:, at:at + HF_CHUNK]
            positions = torch.arange(start + at, start + at + piece.shape[1], device=device)
            out = hf_model(input_ids=piece, **{cache_keyword(hf_model): caches[id(hf_model)]},
                        use_cache=True, cache_position=positions, position_ids=positions[None],
                        logits_to_keep=1)
        return out.logits[0, -1].float()

    with torch.no_grad():
        mine = engine.prefill(prompt[0])
        if graph:
            engine.capture()
        tokens, start = prompt, 0
        for _ in range(steps + 1):
            theirs = hf_logits(hf, tokens, start)
            result.errors.append(relative_error(mine, theirs))
            result.argmax_agree += int(mine.argmax() == theirs.argmax())
            if reference is not None:
                truth = hf_logits(reference, tokens, start)
                result.engine_vs_fp32.append(relative_error(mine, truth))
                result.hf_vs_fp32.append(relative_error(theirs, truth))
            if original is not None:
                unquantised = hf_logits(original, tokens, start)
                result.quant_vs_16bit.append(relative_error(mine, unquantised))
                result.quant_argmax_agree += int(mine.argmax() == unquantised.argmax())
            if len(result.errors) == steps + 1:
                break
            start += tokens.shape[1]
            tokens = theirs.argmax().view(1, 1)
            engine.token.copy_(tokens.view(1))  # both continue from transformers' choice
            engine.step()
            mine = engine.logits.clone()
    engine.close()
    return result

