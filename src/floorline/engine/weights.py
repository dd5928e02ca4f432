"""The decoder's weights in the engine's layout: q, k and v fused into one matrix (one product
per layer instead of three), everything else as the checkpoint stores it ([out, in] rows).
Phi-3 checkpoints store qkv_proj fused already, and gate_up_proj, which is split into gate and
up; Gemma's RMSNorm weights w act as (1 + w), and are stored so, in fp32 (a bfloat16 1 + w
would lose w's low bits).

The decoder's linears are in one of the engine's formats (floorline.engine.quant): the 16-bit
dtype, int4 or fp8; the LM head is 16-bit or fp8; embeddings, norms and biases stay 16-bit.

Sources: a Hugging Face checkpoint directory (sharded safetensors, read straight onto the
device): 16-bit (quantised at load where another format is asked for), AutoAWQ GEMM or GPTQ int4
(repacked), or fp8 with per-row or per-tensor scales; any mapping of Hugging Face names to
tensors (a transformers model's state_dict, for the comparisons); or seeded random weights drawn
on the device (int4 drawn in AWQ's layout and repacked, as a checkpoint's would be).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from floorline.engine import quant
from floorline.errors import FloorlineError, one_line
from floorline.layouts import awq
from floorline.models import no_tensor, safetensors_files
from floorline.traffic import ENGINE_INT4_GROUPS, engine_int4_group


@dataclass
class LayerWeights:  # matrices: a tensor, quant.Int4Weight or quant.Fp8Weight
    wqkv: object
    bqkv: torch.Tensor | None
    wo: object
    bo: torch.Tensor | None
    wgate: object
    wup: object
    wdown: object
    ln1: torch.Tensor
    ln2: torch.Tensor
    q_norm: torch.Tensor | None = None  # per-head RMSNorm of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # norms of the attention's and MLP's outputs (Gemma)
    post_mlp: torch.Tensor | None = None


@dataclass
class DecoderWeights:
    embed: torch.Tensor
    head: object  # the embedding table itself when tied and 16-bit
    norm: torch.Tensor
    layers: list[LayerWeights]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor the engine reads, by Hugging Face name, from the config:
    matrices [out, in], vectors [n]."""
    c = config
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab, c.hidden), "model.norm.weight": (c.hidden,)}
    if not c.tied:
        shapes["lm_head.weight"] = (c.vocab, c.hidden)
    for i in range(c.layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if c.fused:
            shapes.update({a + "qkv_proj.weight": (q + 2 * kv, c.hidden),
                           p + "mlp.gate_up_proj.weight": (2 * c.intermediate, c.hidden)})
        else:
            shapes.update({a + "q_proj.weight": (q, c.hidden), a + "k_proj.weight": (kv, c.hidden),
                           a + "v_proj.weight": (kv, c.hidden),
                           p + "mlp.gate_proj.weight": (c.intermediate, c.hidden),
                           p + "mlp.up_proj.weight": (c.intermediate, c.hidden)})
        shapes.update({a + "o_proj.weight": (c.hidden, q),
                       p + "mlp.down_proj.weight": (c.hidden, c.intermediate),
                       p + "input_layernorm.weight": (c.hidden,),
                       p + "post_attention_layernorm.weight": (c.hidden,)})
        if c.qk_norm:
            shapes.update({a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)})
        if c.gemma:
            shapes.update({p + "pre_feedforward_layernorm.weight": (c.hidden,),
                           p + "post_feedforward_layernorm.weight": (c.hidden,)})
        if c.qkv_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,),
                           a + "v_proj.bias": (kv,)})
        if c.o_bias:
            shapes[a + "o_proj.bias"] = (c.hidden,)
    return shapes


def int4_group(config, group_size: int | None = None) -> int:
    """The int4 group of `config`'s matrices (a DecoderConfig): `group_size`, or where None the
    largest of 128, 64 and 32 that divides every matrix width (hidden, heads x head_dim,
    intermediate). ValueError, one line naming the widths, where there is none or it does not
    divide them."""
    c = config
    widths = sorted({c.hidden, c.heads * c.head_dim, c.intermediate})
    listed = ", ".join(map(str, widths))
    if group_size is None:
        group = engine_int4_group(widths)
        if group is None:
            raise ValueError(f"int4 needs matrix widths ({listed}) that are multiples of 32 "
                             "(its groups are 128, 64 or 32 along K)")
        return group
    if group_size not in ENGINE_INT4_GROUPS:
        raise ValueError(f"int4 group size {group_size}: the engine's are "
                         f"{', '.join(map(str, ENGINE_INT4_GROUPS))}")
    if any(k % group_size for k in widths):
        raise ValueError(f"int4 group {group_size} needs every matrix width ({listed}) to be a "
                         "multiple of it")
    return group_size


def _group(config, weights: str, group_size: int | None, source: str) -> int | None:
    """The int4 group to run `weights` at (int4_group; None for another format), or one line
    naming `source` where there is none."""
    if weights != "int4":
        if group_size is not None:
            raise FloorlineError(f"{source}: a group size is for int4 weights, not {weights}")
        return None
    try:
        return int4_group(config, group_size)
    except ValueError as e:
        raise FloorlineError(f"{source}: {e}") from None


def from_named(config, get: Callable[[str], torch.Tensor], device, dtype, *,
               weights: str = "bf16", head: str = "bf16", group_size: int | None = None,
               linear: Callable[[str], object] | None = None, head_weight=None,
               source: str = "the weights") -> DecoderWeights:
    """Weights from Hugging Face parameter names; `get(name)` returns the tensor. The decoder's
    linears are quantised to `weights` and the LM head to `head` (16-bit: `dtype` as it is);
    int4 in groups of `group_size` (None: int4_group's choice). `linear(prefix)`, where given,
    returns a linear already in its format (a packed checkpoint's); `head_weight(name)`, where
    given, the LM head in its own. A tensor whose shape is not the config's is refused, naming
    `source`."""
    shapes = expected_shapes(config)
    group_size = _group(config, weights, group_size, source)

    def check(name, value):
        if tuple(value.shape) != shapes[name]:
            raise FloorlineError(f"{source}: '{name}' has shape {list(value.shape)}, where the "
                                 f"config makes it {list(shapes[name])}")
        return value

    def take(name):
        return check(name, get(name)).to(device=device, dtype=dtype)

    def norm(name):
        if config.gemma:  # (1 + w), in fp32
            return 1.0 + check(name, get(name)).to(device=device, dtype=torch.float32)
        return take(name)

    def matrix(prefix):
        if linear is not None:
            return check(prefix + ".weight", linear(prefix))
        return quant.quantise(take(prefix + ".weight"), weights, group_size)

    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if config.fused:
            wqkv = matrix(a + "qkv_proj")
            try:
                wgate, wup = quant.split_rows(matrix(p + "mlp.gate_up_proj"), config.intermediate)
            except ValueError as e:
                raise FloorlineError(f"{source}: {p}mlp.gate_up_proj: {e}") from None
        else:
            wqkv = quant.fuse_rows([matrix(a + f"{x}_proj") for x in "qkv"])
            wgate, wup = matrix(p + "mlp.gate_proj"), matrix(p + "mlp.up_proj")
        after = "pre_feedforward_layernorm" if config.gemma else "post_attention_layernorm"
        layers.append(LayerWeights(
            wqkv=wqkv,
            bqkv=(torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"]) if config.qkv_bias
                  else None),
            wo=matrix(a + "o_proj"),
            bo=take(a + "o_proj.bias") if config.o_bias else None,
            wgate=wgate, wup=wup, wdown=matrix(p + "mlp.down_proj"),
            ln1=norm(p + "input_layernorm.weight"), ln2=norm(p + after + ".weight"),
            q_norm=norm(a + "q_norm.weight") if config.qk_norm else None,
            k_norm=norm(a + "k_norm.weight") if config.qk_norm else None,
            post_attn=norm(p + "post_attention_layernorm.weight") if config.gemma else None,
            post_mlp=norm(p + "post_feedforward_layernorm.weight") if config.gemma else None,
        ))
    embed = take("model.embed_tokens.weight")
    if head_weight is not None:
        head_matrix = head_weight("model.embed_tokens" if config.tied else "lm_head")
        check("model.embed_tokens.weight" if config.tied else "lm_head.weight", head_matrix)
    else:
        head_matrix = quant.quantise(embed if config.tied else take("lm_head.weight"), head)
    return DecoderWeights(embed, head_matrix, norm("model.norm.weight"), layers)


def checkpoint_format(qc: dict | None, name: str) -> tuple[str, int | None]:
    """How a checkpoint stores its linears, from its quantization_config, and the group size of
    an int4 one: "bf16" (16-bit), "awq" (AutoAWQ GEMM, 4 bits, zero points), "gptq" (v1,
    4 bits, act-order off), each in groups of 32, 64 or 128, or "fp8" (float8 e4m3 with
    per-row or per-tensor scales, checked per linear); anything else is refused in one line."""
    if qc is None:
        return "bf16", None
    method = qc.get("quant_method")
    if method == "awq":
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        if (qc.get("version", "gemm").lower() != "gemm" or not qc.get("zero_point", True)
                or bits != 4 or group not in ENGINE_INT4_GROUPS):
            raise FloorlineError(f"{name}: the engine runs AutoAWQ GEMM checkpoints of 4 bits, "
                                 "groups of 32, 64 or 128, with zero points (quantization_config: "
                                 f"{qc})")
        return "awq", group
    if method == "gptq":
        group = qc.get("group_size")
        if qc.get("bits") != 4 or group not in ENGINE_INT4_GROUPS:
            raise FloorlineError(f"{name}: the engine runs GPTQ checkpoints of 4 bits, groups "
                                 f"of 32, 64 or 128 (quantization_config: {qc})")
        if qc.get("desc_act") or qc.get("act_order"):
            raise FloorlineError(f"{name}: GPTQ with act-order (desc_act) reorders the input "
                                 "rows, which the engine does not run")
        if qc.get("checkpoint_format", "gptq") != "gptq":
            raise FloorlineError(f"{name}: GPTQ checkpoint format "
                                 f"'{qc.get('checkpoint_format')}' (the engine reads v1, 'gptq')")
        return "gptq", group
    if method in ("fp8", "fbgemm_fp8", "compressed-tensors"):
        return "fp8", None
    raise FloorlineError(f"{name}: quantization method '{method}' is not one the engine runs "
                         "(AWQ, GPTQ, fp8 with per-row scales)")


ENGINE_FORMAT = {"bf16": "bf16", "awq": "int4", "gptq": "int4", "fp8": "fp8"}
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def _packed_linear(stored: str, get, has, directory, device, group_size):
    """A loader of one linear from a pre-quantised checkpoint, or None for a 16-bit one."""
    def fail(prefix, e):
        return FloorlineError(f"{directory}: {prefix}: {e}")

    if stored in ("awq", "gptq"):
        names = ("qweight", "qzeros", "scales") + (("g_idx",) if stored == "gptq" else ())
        convert = quant.int4_from_awq if stored == "awq" else quant.int4_from_gptq

        def int4(prefix):
            t = {n: get(f"{prefix}.{n}").to(device) for n in names
                 if n != "g_idx" or has(f"{prefix}.{n}")}
            try:
                return convert(t, group_size)
            except ValueError as e:
                raise fail(prefix, e) from None
        return int4
    if stored == "fp8":
        def fp8(prefix):
            scale = prefix + ".weight_scale"
            if not has(scale):
                raise FloorlineError(f"{directory}: no {scale} beside the fp8 weight")
            try:
                return quant.fp8_from_checkpoint(get(prefix + ".weight").to(device),
                                                 get(scale).to(device))
            except ValueError as e:
                raise fail(prefix, e) from None
        return fp8
    return None


def load_checkpoint(directory: Path, config, device, dtype, *, weights: str | None = None,
                    head: str = "bf16", quantization: dict | None = None,
                    group_size: int | None = None) -> DecoderWeights:
    """A checkpoint directory's safetensors shards, each tensor read onto `device` as needed.
    `weights` is the format to run (None: the checkpoint's own); a 16-bit checkpoint is
    quantised to it at load (int4 in groups of `group_size`, None: int4_group's choice), a
    quantised one must already be in it (an int4 one at its own group size)."""
    from safetensors import safe_open

    where = {}
    for f in safetensors_files(directory):
        try:
            handle = safe_open(str(f), framework="pt", device=str(device))
        except Exception as e:  # SafetensorError: a truncated or foreign file
            raise FloorlineError(f"{f} is not a readable safetensors file "
                                 f"({one_line(e)})") from None
        for name in handle.keys():
            if name in where:
                raise FloorlineError(f"{directory}: tensor '{name}' is in more than one "
                                     "safetensors file")
            where[name] = handle

    # The text decoder's names: model.* (a causal LM), or under the language model of a
    # vision-language checkpoint (Gemma 3 4B and up)
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in where), "model.")

    def get(name):
        stored = prefix + name.removeprefix("model.") if name.startswith("model.") else name
        if stored not in where:
            raise FloorlineError(f"{no_tensor(directory, stored)} (the engine reads Hugging "
                                 "Face Llama, Qwen2, Mistral, Qwen3, Gemma 3 and Phi-3 names)")
        try:
            return where[stored].get_tensor(stored)
        except Exception as e:  # data cut short after an intact header
            raise FloorlineError(f"{directory}: tensor '{stored}' cannot be read "
                                 f"({one_line(e)})") from None

    stored, stored_group = checkpoint_format(quantization, str(directory))
    own = ENGINE_FORMAT[stored]
    weights = weights or own
    if own != "bf16" and weights != own:
        raise FloorlineError(f"{directory} is a {stored} checkpoint of {own} weights; run it as "
                             f"{own}, not {weights}")
    if stored_group is not None:
        if group_size not in (None, stored_group):
            raise FloorlineError(f"{directory} is a {stored} checkpoint of int4 group "
                                 f"{stored_group}; run it at group {stored_group}, not "
                                 f"{group_size}")
        group_size = stored_group
    def has(name):
        return prefix + name.removeprefix("model.") in where

    linear = _packed_linear(stored, get, has, directory, device, stored_group)
    return from_named(config, get, device, dtype, weights=weights, head=head,
                      group_size=group_size, linear=linear, source=str(directory))


def random_weights(config, device, dtype, seed: int, *, weights: str = "bf16",
                   head: str = "bf16", group_size: int | None = None) -> DecoderWeights:
    """Seeded normal(0, initializer_range) matrices and biases, norms near one, drawn on the
    device (a 7B model in seconds on a GPU); int4 matrices are drawn in AWQ's layout with the
    same spread and repacked (in groups of `group_size`, None: int4_group's choice), fp8 ones
    quantised from 16-bit draws."""
    group_size = _group(config, weights, group_size, "random weights")
    generator = torch.Generator(device=device).manual_seed(seed)
    c = config

    def normal(*shape, mean=0.0, std=c.initializer_range):
        return torch.empty(shape, device=device, dtype=dtype).normal_(mean, std,
                                                                       generator=generator)

    def matrix(n, k):
        if weights == "int4":
            return quant.int4_from_awq(awq.random(n, k, group_size, generator, device,
                                                  std=c.initializer_range), group_size)
        return quant.quantise(normal(n, k), weights)

    def norm(n=c.hidden):  # as loaded: Gemma's (1 + w) in fp32
        w = normal(n, mean=1.0, std=0.02)
        return w.float() if c.gemma else w

    def optional(present, n=c.hidden):
        return norm(n) if present else None

    layers = [LayerWeights(
        wqkv=matrix(c.qkv_rows, c.hidden),
        bqkv=normal(c.qkv_rows) if c.qkv_bias else None,
        wo=matrix(c.hidden, c.heads * c.head_dim),
        bo=normal(c.hidden) if c.o_bias else None,
        wgate=matrix(c.intermediate, c.hidden), wup=matrix(c.intermediate, c.hidden),
        wdown=matrix(c.hidden, c.intermediate), ln1=norm(), ln2=norm(),
        q_norm=optional(c.qk_norm, c.head_dim), k_norm=optional(c.qk_norm, c.head_dim),
        post_attn=optional(c.gemma), post_mlp=optional(c.gemma),
    ) for _ in range(c.layers)]
    embed = normal(c.vocab, c.hidden)
    head_matrix = embed if c.tied else normal(c.vocab, c.hidden)
    return DecoderWeights(embed, quant.quantise(head_matrix, head), norm(), layers)
