"""The analytic memory floor: bytes one batch-1 decode step must move, over peak bandwidth.

Parameters are counted from the config's sizes for the shipped families (FAMILIES), which the
tests check against the built model; any other decoder transformers can build is built on the
meta device and counted from its modules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache

from floorline.errors import FloorlineError
from floorline.hardware import DeviceSpec
from floorline.models.zoo import ModelSpec


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint format stores the weights one step reads.

    The decoder's linear layers hold `bits` per weight, and every `group_size` weights of a row
    share `group_bits` of metadata (scales, zeros, absmax); group_size 0 means one group per
    output row. The LM head holds `head_bits` per weight (its metadata included) plus
    `head_row_bits` per row, the one input embedding row a step reads `embed_bits`, and norms
    and biases `dense_bits`.
    """

    name: str
    bits: float
    group_size: int = 0
    group_bits: float = 0.0
    head_bits: float = 16
    head_bits_unaligned: float | None = None  # a k-quant head whose rows are not 256-aligned
    head_row_bits: float = 0.0
    embed_bits: float = 16
    dense_bits: int = 16
    source: str = ""

    def linear_bytes(self, out_features: int, in_features: int) -> float:
        n = out_features * in_features
        groups = out_features if self.group_size == 0 else n / self.group_size
        return (n * self.bits + groups * self.group_bits) / 8

    def head_bytes(self, vocab: int, hidden: int) -> float:
        aligned = self.head_bits_unaligned is None or hidden % 256 == 0
        bits = self.head_bits if aligned else self.head_bits_unaligned
        return (vocab * hidden * bits + vocab * self.head_row_bits) / 8


# The engine's int4 group sizes along K, largest first (floorline.engine.quant's layout).
ENGINE_INT4_GROUPS = (128, 64, 32)


def engine_int4_group(widths) -> int | None:
    """The group the engine's int4 runs at where none is asked for: the largest of
    ENGINE_INT4_GROUPS that divides every matrix width (the K of each linear); None where none
    does."""
    return next((g for g in ENGINE_INT4_GROUPS if all(k % g == 0 for k in widths)), None)


# GGUF block types (ggml-common.h): Q4_0 = fp16 scale + 32 4-bit weights (18 bytes per 32),
# Q4_1 the same with an fp16 minimum (20);
# Q6_K = 256 weights in 210 bytes (6.5625 bits); Q8_0 = 34 bytes per 32. llama.cpp's Q4_0 files
# keep the LM head in Q6_K (Q8_0 where a row is not a multiple of 256) and norms in F32.
Q4_0_BITS, Q6_K_BITS, Q8_0_BITS = 18 * 8 / 32, 210 * 8 / 256, 34 * 8 / 32
Q4_1_BITS = 20 * 8 / 32

WEIGHT_FORMATS = {
    f.name: f
    for f in (
        WeightFormat("bf16", 16),
        WeightFormat("fp16", 16),
        WeightFormat("fp32", 32, head_bits=32, embed_bits=32, dense_bits=32),
        WeightFormat("bf16-fp8head", 16, head_bits=8, head_row_bits=32,
                     source="floorline's engine in bf16 with its LM head in fp8 (e4m3), one fp32 "
                            "scale per row"),
        WeightFormat("fp32-fp8head", 32, head_bits=8, head_row_bits=32, embed_bits=32,
                     dense_bits=32, source="the engine in float32 with its LM head in fp8"),
        WeightFormat("int8", 8, 0, 16, source="int8 with one fp16 scale per output row"),
        WeightFormat("int4-g128", 4, 128, 32,
                     source="int4 with a 16-bit scale and a 16-bit zero per 128 (torchao's "
                            "tinygemm layout, Int4TilePackedTo4dTensor)"),
        WeightFormat("nf4", 4, 64, 32, source="bitsandbytes NF4: one fp32 absmax per 64"),
        WeightFormat("nf4-dq", 4, 64, 8 + 32 / 256,
                     source="bitsandbytes NF4 with double quantisation: int8 absmax per 64, "
                            "fp32 per 256 of those"),
        WeightFormat("bnb-int8", 8, 0, 32,
                     source="bitsandbytes LLM.int8: int8 weights, one fp32 scale (SCB) per row"),
        WeightFormat("gptq-int4-g128", 4, 128, 16 + 4,
                     source="GPTQ: int32-packed int4 qweight, fp16 scale and 4-bit packed zero "
                            "per 128 (g_idx is not read when act-order is off)"),
        WeightFormat("awq-int4-g128", 4, 128, 16 + 4,
                     source="AWQ (AutoAWQ GEMM): int4 qweight, fp16 scale and 4-bit packed zero "
                            "per 128; Marlin's repacked form holds the same"),
        *(WeightFormat(f"engine-int4-g{g}", 4, g, 16 + 8,
                       source=f"floorline's engine int4: fp16 scale and uint8 zero point per {g} "
                              "along K, repacked from AWQ/GPTQ or quantised at load")
          for g in ENGINE_INT4_GROUPS),
        *(WeightFormat(f"engine-int4-g{g}-fp8head", 4, g, 16 + 8, head_bits=8,
                       head_row_bits=32,
                       source=f"the engine's int4 (group {g}) with its LM head in fp8 (e4m3), "
                              "one fp32 scale per row")
          for g in ENGINE_INT4_GROUPS),
        # What an engine-int4 path names: floor() counts the group the engine picks for the
        # model (engine_int4_group); these entries hold group 128's bytes for any other use.
        WeightFormat("engine-int4", 4, 128, 16 + 8,
                     source="floorline's engine int4 at the group it picks for the model: 128 "
                            "where it divides every matrix width, else 64 or 32 (counted as "
                            "engine-int4-g64 or -g32)"),
        WeightFormat("engine-int4-fp8head", 4, 128, 16 + 8, head_bits=8, head_row_bits=32,
                     source="engine-int4 with its LM head in fp8 (e4m3), one fp32 scale per row"),
        WeightFormat("engine-fp8", 8, 0, 32,
                     source="floorline's engine fp8: float8 e4m3 with one fp32 scale per output "
                            "row"),
        WeightFormat("engine-fp8-fp8head", 8, 0, 32, head_bits=8, head_row_bits=32,
                     source="the engine's fp8 with its LM head in fp8 too"),
        # A GGUF's blocks as the engine runs them (floorline.engine.gguf_blocks): Q4_0 as its
        # int4 in groups of 32 (engine-int4-g32, a uint8 zero point per group beside the scale)
        WeightFormat("engine-q4_1", 4, 32, 32,
                     source="GGUF Q4_1 blocks as stored: 4-bit weights, an fp16 scale and an "
                            "fp16 minimum per 32 along K"),
        WeightFormat("engine-q8_0", 8, 32, 16,
                     source="GGUF Q8_0 blocks as stored: int8 weights and an fp16 scale per 32 "
                            "along K"),
        *(WeightFormat(f"{base}-q8_0head", bits, group, group_bits, head_bits=Q8_0_BITS,
                       source=f"{about}, the LM head in GGUF Q8_0 blocks as stored")
          for base, bits, group, group_bits, about in (
              ("engine-q4_1", 4, 32, 32, "GGUF Q4_1 blocks as stored"),
              ("engine-q8_0", 8, 32, 16, "GGUF Q8_0 blocks as stored"),
              ("engine-int4-g32", 4, 32, 24, "GGUF Q4_0 blocks as the engine's int4 (group 32)"),
              ("bf16", 16, 0, 0, "16-bit matrices"))),
        WeightFormat("gguf-bf16", 16, dense_bits=32,
                     source="GGUF BF16: matrices in bf16, norms and biases in F32"),
        WeightFormat("gguf-q4_0", 4, 32, 16, head_bits=Q6_K_BITS, head_bits_unaligned=Q8_0_BITS,
                     embed_bits=Q4_0_BITS, dense_bits=32,
                     source="GGUF Q4_0 as llama.cpp quantises: linears and embeddings Q4_0, "
                            "LM head Q6_K, norms and biases F32"),
        WeightFormat("gguf-q4_1", 4, 32, 32, head_bits=Q6_K_BITS, head_bits_unaligned=Q8_0_BITS,
                     embed_bits=Q4_1_BITS, dense_bits=32,
                     source="GGUF Q4_1 as llama.cpp quantises: linears and embeddings Q4_1, "
                            "LM head Q6_K (Q8_0 where a row is not a multiple of 256), norms "
                            "and biases F32"),
        WeightFormat("gguf-q8_0", 8, 32, 16, head_bits=Q8_0_BITS, embed_bits=Q8_0_BITS,
                     dense_bits=32,
                     source="GGUF Q8_0 as llama.cpp quantises: every matrix Q8_0, norms and "
                            "biases F32"),
    )
}


@dataclass(frozen=True)
class KvFormat:
    """How a KV cache stores each cached token's K and V: `bytes` per element, plus
    `scale_bytes` per head vector (of K, and of V) where each token and head has its own scale."""

    name: str
    bytes: int
    scale_bytes: int = 0
    source: str = ""


KV_FORMATS = {
    f.name: f
    for f in (
        KvFormat("bf16", 2), KvFormat("fp16", 2), KvFormat("fp32", 4),
        KvFormat("fp8", 1, source="fp8 values, one scale per tensor or none (negligible bytes)"),
        KvFormat("engine-fp8", 1, 4,
                 source="floorline's engine fp8 KV cache: e4m3 values and one fp32 scale per "
                        "token and kv head, for K and for V"),
    )
}


def engine_weight_format(weights: str, head: str, dtype_format: str = "bf16",
                         group_size: int | None = None) -> str:
    """The weight format of floorline's engine running `weights` linears (bf16, int4, fp8) and a
    `head` LM head (bf16, fp8); `dtype_format` names its 16-bit dtype. int4 is named by its
    `group_size`, or where None by the group the engine picks for the model, which floor()
    resolves."""
    group = f"-g{group_size}" if group_size else ""
    base = {"int4": "engine-int4" + group, "fp8": "engine-fp8", "q4_1": "engine-q4_1",
            "q8_0": "engine-q8_0"}.get(weights, dtype_format)
    return base + ("" if head == "bf16" else f"-{head}head")


# The engine's name for the format it holds a GGUF tensor of each type in (engine.quant)
GGUF_ENGINE_FORMATS = {"Q4_0": "int4", "Q4_1": "q4_1", "Q8_0": "q8_0", "F32": "bf16",
                       "F16": "bf16", "BF16": "bf16"}


def engine_gguf_format(model_spec: ModelSpec) -> str:
    """The weight format of the engine running a model directory's GGUF file as stored
    (`engine-gguf`): its layer matrices' one type and its LM head's, read from the file."""
    from floorline.models.gguf_checkpoint import model_gguf, stored_types

    path = model_gguf(model_spec)
    matrices, head = stored_types(path)
    unknown = sorted((matrices | {head}) - set(GGUF_ENGINE_FORMATS))
    if unknown:
        raise FloorlineError(f"{path}: tensors of type {', '.join(unknown)}, which the engine "
                             f"does not run as stored ({', '.join(GGUF_ENGINE_FORMATS)} only)")
    kinds = sorted({GGUF_ENGINE_FORMATS[t] for t in matrices})
    if len(kinds) != 1:
        raise FloorlineError(f"{path}: its layer matrices mix types ({', '.join(sorted(matrices))}"
                             "), which no one weight format names")
    weights = kinds[0]
    return engine_weight_format(weights, GGUF_ENGINE_FORMATS[head],
                                group_size=32 if weights == "int4" else None)


@dataclass(frozen=True)
class ParamCounts:
    total: int  # unique parameters (a tied table once)
    input_embedding: int
    tied: bool
    hidden_size: int
    linear_shapes: tuple[tuple[int, int], ...]  # (out, in) of every linear but the LM head
    linear_bias: int  # bias elements of those linears

    @property
    def matrix_shapes(self) -> tuple[tuple[int, int], ...]:
        """(out, in) of every matrix a step multiplies by: the linears and the LM head (which
        has the input table's shape, tied or not)."""
        vocab = self.input_embedding // self.hidden_size
        return (*self.linear_shapes, (vocab, self.hidden_size))


@dataclass(frozen=True)
class Floor:
    model: str
    gpu: str
    ctx: int
    weight_format: str
    kv_dtype: str
    weight_bytes: int
    kv_bytes: int
    total_bytes: int
    peak_gbps: float
    floor_ms: float
    total_bytes_all_params: int
    floor_ms_all_params: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Family:
    """A decoder family's layer as transformers builds it, beyond the config's sizes: whether
    its q/k/v, output and MLP linears have a bias (True, or the config field that says), its
    norms of the hidden size, whether q and k are normed per head, and whether q/k/v and
    gate/up are each one fused linear."""

    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    norms: int = 2
    head_norms: bool = False
    fused: bool = False

    def bias(self, cfg, qkv: int, out: int, mlp: int) -> int:
        """Bias elements of a layer whose q/k/v, output and MLP linears have qkv, out and mlp
        outputs."""
        def has(bias: bool | str) -> bool:
            return bias if isinstance(bias, bool) else bool(getattr(cfg, bias, False))

        return has(self.qkv_bias) * qkv + has(self.o_bias) * out + has(self.mlp_bias) * mlp


FAMILIES = {
    "llama": Family(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qkv_bias="attention_bias", o_bias="attention_bias", head_norms=True),
    "gemma3_text": Family(qkv_bias="attention_bias", o_bias="attention_bias", norms=4,
                          head_norms=True),
    "phi3": Family(fused=True),
}


@cache
def count_parameters(model_spec: ModelSpec) -> ParamCounts:
    """The language model's parameters (a vision-language checkpoint's too: a decode step reads
    none of its vision tower)."""
    family = FAMILIES.get(model_spec.text.model_type)
    if family is None or model_spec.trust_remote_code:  # remote code builds modules of its own
        return counts_from_model(model_spec)
    return counts_from_sizes(model_spec.text, family)


def counts_from_sizes(cfg, family: Family) -> ParamCounts:
    """A text config's parameters by arithmetic on its sizes, the linears in the order the
    built model holds them."""
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv_heads, head_dim = kv_heads_and_dim(cfg)
    q, kv = cfg.num_attention_heads * head_dim, kv_heads * head_dim
    if family.fused:  # Phi-3 registers its output linear before the fused q/k/v
        linears = [(h, q), (q + 2 * kv, h), (2 * inter, h), (h, inter)]
    else:
        linears = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
    bias = family.bias(cfg, q + 2 * kv, h, 2 * inter + h)
    norms = family.norms * h + family.head_norms * 2 * head_dim
    per_layer = sum(o * i for o, i in linears) + bias + norms
    layers, tied = cfg.num_hidden_layers, cfg.tie_word_embeddings
    return ParamCounts(
        total=layers * per_layer + vocab * h * (1 if tied else 2) + h,  # and the final norm
        input_embedding=vocab * h,
        tied=tied,
        hidden_size=h,
        linear_shapes=tuple(linears * layers),
        linear_bias=layers * bias,
    )


def counts_from_model(model_spec: ModelSpec) -> ParamCounts:
    """The parameters of the language model built on the meta device, from its modules."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = model_spec.config.get_text_config()
    try:
        with torch.device("meta"):
            hf_model = AutoModelForCausalLM.from_config(
                config, trust_remote_code=model_spec.trust_remote_code
            )
    except Exception as e:  # transformers raises many kinds for configs it cannot build
        raise FloorlineError(f"{model_spec.name}: cannot build the model from its config "
                             f"({e})") from None
    embed = hf_model.get_input_embeddings().weight
    head_module = hf_model.get_output_embeddings()
    head = head_module.weight if head_module is not None else None
    shapes, bias = [], 0
    for module in hf_model.modules():
        if module is head_module:
            continue
        if isinstance(module, torch.nn.Linear):
            shapes.append((module.out_features, module.in_features))
        elif isinstance(module, Conv1D):  # GPT-2 style: weight is (in, out)
            shapes.append((module.weight.shape[1], module.weight.shape[0]))
        else:
            continue
        bias += module.bias.numel() if module.bias is not None else 0
    return ParamCounts(
        total=sum(p.numel() for p in hf_model.parameters()),
        input_embedding=embed.numel(),
        tied=head is not None and head is embed,
        hidden_size=embed.shape[1],
        linear_shapes=tuple(shapes),
        linear_bias=bias,
    )


def weight_bytes(counts: ParamCounts, fmt: WeightFormat) -> int:
    """Weights one step reads: all but the input table, of which one row (a tied table is read
    whole, once, as the LM head)."""
    linear_params = sum(o * i for o, i in counts.linear_shapes) + counts.linear_bias
    table = counts.input_embedding  # an untied head has the input table's shape
    dense = counts.total - linear_params - table - (0 if counts.tied else table)
    linear = sum(fmt.linear_bytes(o, i) for o, i in counts.linear_shapes)
    row = 0 if counts.tied else counts.hidden_size
    head = fmt.head_bytes(*counts.matrix_shapes[-1])
    return round(linear + head + row * fmt.embed_bits / 8
                 + (counts.linear_bias + dense) * fmt.dense_bits / 8)


def kv_heads_and_dim(config) -> tuple[int, int]:
    cfg = config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return kv_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def kv_layout(config) -> tuple[int, list[int | None]]:
    """Bytes per cached token per layer per element-byte (2 x kv heads x head dim), and each
    layer's attention window (None = full attention)."""
    cfg = config.get_text_config()
    kv_heads, head_dim = kv_heads_and_dim(config)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        windowed = window is not None and getattr(cfg, "use_sliding_window", True)
        kind = "sliding_attention" if windowed else "full_attention"
        layer_types = [kind] * cfg.num_hidden_layers
    windows = [window if "sliding" in t else None for t in layer_types]
    return 2 * kv_heads * head_dim, windows


def kv_bytes(config, ctx: int, kv_dtype: str) -> int:
    """K and V of `ctx` cached tokens in every layer (at most the window in a windowed layer),
    plus the new token's K and V written; with their scales where the format has them."""
    _, windows = kv_layout(config)
    kv_heads, head_dim = kv_heads_and_dim(config)
    fmt = KV_FORMATS[kv_dtype]
    per_token = 2 * kv_heads * (head_dim * fmt.bytes + fmt.scale_bytes)
    return sum(per_token * ((ctx if w is None else min(ctx, w)) + 1) for w in windows)


# Weight formats a path names that stand for another, resolved per model (resolve_weight_format)
RESOLVED_FORMATS = ("engine-gguf",)


def resolve_weight_format(name: str, model_spec: ModelSpec, counts: ParamCounts) -> str:
    """`name`, or for engine-int4 (the engine's automatic group) the format of the group it
    picks for the model whose linears `counts` holds, and for engine-gguf the format of the
    model's GGUF file (engine_gguf_format)."""
    if name == "engine-gguf":
        return engine_gguf_format(model_spec)
    if name not in ("engine-int4", "engine-int4-fp8head"):
        return name
    group = engine_int4_group({i for _, i in counts.linear_shapes})
    return name if group is None else name.replace("int4", f"int4-g{group}", 1)


def engine_kv_format(kv: str, dtype_format: str = "bf16") -> str:
    """The KV format of floorline's engine with a `kv` cache (bf16: its 16-bit dtype, named by
    `dtype_format`; fp8)."""
    return "engine-fp8" if kv == "fp8" else dtype_format


def floor(model_spec: ModelSpec, gpu: DeviceSpec, ctx: int, weight_format: str = "bf16",
          kv_dtype: str = "bf16") -> Floor:
    if weight_format not in WEIGHT_FORMATS and weight_format not in RESOLVED_FORMATS:
        raise FloorlineError(f"unknown weight format '{weight_format}'; known: "
                             f"{', '.join(WEIGHT_FORMATS)}")
    if kv_dtype not in KV_FORMATS:
        raise FloorlineError(f"unknown KV dtype '{kv_dtype}'; known: {', '.join(KV_FORMATS)}")
    counts = count_parameters(model_spec)
    weight_format = resolve_weight_format(weight_format, model_spec, counts)
    fmt = WEIGHT_FORMATS[weight_format]
    w = weight_bytes(counts, fmt)
    kv = kv_bytes(model_spec.text, ctx, kv_dtype)
    # The study's convention: every parameter (the whole input table too) plus the KV cache.
    all_params = w + round((0 if counts.tied else counts.input_embedding - counts.hidden_size)
                           * fmt.embed_bits / 8)
    bytes_per_ms = gpu.peak_gbps * 1e6
    return Floor(
        model=model_spec.name, gpu=gpu.name, ctx=ctx, weight_format=weight_format,
        kv_dtype=kv_dtype,
        weight_bytes=w, kv_bytes=kv, total_bytes=w + kv, peak_gbps=gpu.peak_gbps,
        floor_ms=(w + kv) / bytes_per_ms,
        total_bytes_all_params=all_params + kv,
        floor_ms_all_params=(all_params + kv) / bytes_per_ms,
    )
