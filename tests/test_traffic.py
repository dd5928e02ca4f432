"""The analytic floor against independent arithmetic from each config.json's own fields."""

import pytest

from conftest import shipped_config
from floorline.hardware import lookup
from floorline.models import resolve_model, shipped_models
from floorline.traffic import WEIGHT_FORMATS, count_parameters, floor


def expected_counts(cfg: dict) -> tuple[int, int, int]:
    """(total unique params, input embedding params, params of the decoder's linears) for the
    Llama / Qwen2 / Mistral / Qwen3 / Gemma 3 / Phi-3 families, counted by hand."""
    h, inter, layers, vocab = (cfg["hidden_size"], cfg["intermediate_size"],
                               cfg["num_hidden_layers"], cfg["vocab_size"])
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // heads)
    linears = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter
    bias = (heads * hd + 2 * kv * hd) if cfg["model_type"] == "qwen2" else 0
    norms = 2 * h  # two RMSNorms; Qwen3 and Gemma 3 normalise q and k per head too, and
    # Gemma 3 the attention's and the MLP's outputs
    norms += {"qwen3": 2 * hd, "gemma3_text": 2 * hd + 2 * h}.get(cfg["model_type"], 0)
    per_layer = linears + bias + norms
    embed = vocab * h
    head = 0 if cfg["tie_word_embeddings"] else vocab * h
    return layers * per_layer + embed + head + h, embed, layers * linears


def expected_kv_bytes(cfg: dict, ctx: int, elem: int = 2) -> int:
    h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim", h // heads)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    # Gemma 3: every sliding_window_pattern-th layer is global, the others windowed
    pattern = cfg.get("sliding_window_pattern")
    windows = [None if pattern and (i + 1) % pattern == 0 else window for i in range(layers)]
    read = sum(ctx if w is None else min(ctx, w) for w in windows)
    return 2 * cfg["num_key_value_heads"] * hd * elem * (read + layers)


@pytest.mark.parametrize("name", shipped_models())
@pytest.mark.parametrize("ctx", [1, 300, 2048, 16384])
def test_bf16_floor_matches_hand_count(name, ctx):
    cfg = shipped_config(name)
    total, embed, _ = expected_counts(cfg)
    weights = (total if cfg["tie_word_embeddings"] else total - embed + cfg["hidden_size"]) * 2
    kv = expected_kv_bytes(cfg, ctx)
    f = floor(resolve_model(name), lookup("l4"), ctx)
    assert count_parameters(resolve_model(name)).total == total
    assert (f.weight_bytes, f.kv_bytes, f.total_bytes) == (weights, kv, weights + kv)
    assert f.floor_ms == pytest.approx((weights + kv) / 300e9 * 1e3, rel=1e-12)
    all_params = total * 2 + kv
    assert f.total_bytes_all_params == all_params
    assert f.floor_ms_all_params == pytest.approx(all_params / 300e9 * 1e3, rel=1e-12)


def test_qwen_reference_counts_and_h200_floor():
    # Reference parameter counts and the hand-run baselines' H200 floors (2.97 / 3.14 ms).
    counts = count_parameters(resolve_model("qwen2.5-7b"))
    assert (counts.total, counts.input_embedding, counts.tied) == (7_615_616_512, 544_997_376,
                                                                   False)
    h200 = lookup("h200")
    assert floor(resolve_model("qwen2.5-7b"), h200, 2048).floor_ms == pytest.approx(2.97, abs=0.005)
    assert floor(resolve_model("qwen2.5-7b"), h200, 16384).floor_ms == pytest.approx(3.14,
                                                                                     abs=0.005)
    assert floor(resolve_model("qwen2.5-7b"), h200, 2048).weight_bytes == 14_141_245_440


# Published parameter counts: (total, without the embedding tables), each to the precision it is
# published at. Qwen3: the model cards ("Number of Parameters", "(Non-Embedding)"); Gemma 3: the
# technical report's table 1 (non-embedding parameters of the language model, in millions);
# Phi-4-mini: its model card (3.8B).
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, 0.1e9, 0.44e9, 0.01e9), "qwen3-1.7b": (1.7e9, 0.1e9, 1.4e9, 0.1e9),
    "qwen3-4b": (4.0e9, 0.1e9, 3.6e9, 0.1e9), "qwen3-8b": (8.2e9, 0.1e9, 6.95e9, 0.01e9),
    "gemma-3-1b": (None, None, 698e6, 1e6), "gemma-3-4b": (None, None, 3209e6, 1e6),
    "gemma-3-12b": (None, None, 10759e6, 1e6), "phi-4-mini": (3.8e9, 0.1e9, None, None),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_the_published_figures(name):
    total, total_step, body, body_step = PUBLISHED[name]
    counts = count_parameters(resolve_model(name))
    tables = counts.input_embedding * (1 if counts.tied else 2)
    if total is not None:
        assert abs(counts.total - total) <= total_step / 2
    if body is not None:
        assert abs(counts.total - tables - body) <= body_step / 2


def test_gemma3_local_layers_read_their_window():
    # 5 of every 6 layers read at most 1024 cached tokens; the floor at 16k counts that
    spec, cfg = resolve_model("gemma-3-12b"), shipped_config("gemma-3-12b")
    per_token_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    f = floor(spec, lookup("h200"), 16384)
    assert f.kv_bytes == per_token_layer * (8 * 16385 + 40 * 1025)
    assert f.kv_bytes * 4 < per_token_layer * 48 * 16385  # under a quarter of full attention's


def test_sliding_window_caps_kv_reads():
    spec = resolve_model("tiny-mistral-swa")  # window 256
    at_window = floor(spec, lookup("l4"), 256).kv_bytes
    assert floor(spec, lookup("l4"), 4000).kv_bytes == at_window
    assert floor(spec, lookup("l4"), 100).kv_bytes < at_window


@pytest.mark.parametrize("fmt, bits_per_weight", [("int4-g128", 4 + 32 / 128), ("nf4", 4 + 32 / 64),
                                                  ("int8", None), ("fp32", 32)])
def test_quantised_formats(fmt, bits_per_weight):
    cfg = shipped_config("llama-3.1-8b")
    total, embed, linears = expected_counts(cfg)
    h = cfg["hidden_size"]
    dense = total - linears - embed + h  # norms, the LM head and one embedding row
    if fmt == "int8":  # one fp16 scale per output row of each linear
        per_layer_rows = (cfg["num_attention_heads"] * 128 + 2 * cfg["num_key_value_heads"] * 128
                          + h + 2 * cfg["intermediate_size"] + h)
        linear_bytes = linears + 2 * cfg["num_hidden_layers"] * per_layer_rows
    else:
        linear_bytes = linears * bits_per_weight / 8
    dense_bytes = dense * (4 if fmt == "fp32" else 2)
    f = floor(resolve_model("llama-3.1-8b"), lookup("h100-sxm5"), 2048, weight_format=fmt)
    assert f.weight_bytes == round(linear_bytes + dense_bytes)


def test_kv_dtype_scales_kv_bytes():
    spec = resolve_model("qwen2.5-7b")
    bf16 = floor(spec, lookup("h200"), 8192).kv_bytes
    assert floor(spec, lookup("h200"), 8192, kv_dtype="fp8").kv_bytes * 2 == bf16
    assert floor(spec, lookup("h200"), 8192, kv_dtype="fp32").kv_bytes == 2 * bf16


def test_unknown_formats_are_refused():
    from floorline.errors import FloorlineError

    with pytest.raises(FloorlineError, match="unknown weight format"):
        floor(resolve_model("tiny-llama"), lookup("l4"), 16, weight_format="int3")
    with pytest.raises(FloorlineError, match="unknown KV dtype"):
        floor(resolve_model("tiny-llama"), lookup("l4"), 16, kv_dtype="int2")


def test_any_transformers_decoder_is_counted(tmp_path):
    # GPT-2: Conv1D layers, learned position embeddings, tied head; no floorline-specific code.
    import json

    from transformers import GPT2Config

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    spec = resolve_model(str(tmp_path))
    counts = count_parameters(spec)
    h = 64
    per_layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h) + 4 * h
    assert counts.total == 2 * per_layer + 500 * h + 128 * h + 2 * h
    assert counts.tied
    assert floor(spec, lookup("l4"), 10).weight_bytes == counts.total * 2
    assert floor(spec, lookup("l4"), 10).kv_bytes == 2 * 2 * h * 2 * 11


def test_weight_formats_cover_the_study():
    assert {"bf16", "int4-g128", "nf4"} <= set(WEIGHT_FORMATS)


def linear_rows(cfg: dict) -> int:
    """Output rows of one decoder layer's linears (q, k, v, o, gate, up, down)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // heads)
    return heads * hd + 2 * kv * hd + h + 2 * cfg["intermediate_size"] + h


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama-3.1-8b", "tiny-qwen2"])
@pytest.mark.parametrize("fmt", ["nf4", "bnb-int8", "gptq-int4-g128", "awq-int4-g128",
                                 "int4-g128", "gguf-bf16", "gguf-q4_0"])
def test_library_formats_bytes(name, fmt):
    """Each library layout's bytes per step, from the layout's own definition."""
    cfg = shipped_config(name)
    total, embed, linears = expected_counts(cfg)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head = embed  # the LM head has the table's shape; a tied table is read once, as the head
    untied_head = 0 if cfg["tie_word_embeddings"] else head
    bias = total - linears - embed - untied_head - (2 * layers + 1) * h
    norms = (2 * layers + 1) * h
    row = 0 if cfg["tie_word_embeddings"] else h
    linear_bytes, head_bytes, row_bytes, small_bytes = {
        # bitsandbytes NF4: 4-bit codes + one fp32 absmax per block of 64
        "nf4": (linears / 2 + linears / 64 * 4, head * 2, row * 2, (norms + bias) * 2),
        # LLM.int8: int8 + one fp32 scale per output row
        "bnb-int8": (linears + layers * linear_rows(cfg) * 4, head * 2, row * 2,
                     (norms + bias) * 2),
        # GPTQ / AWQ: 4-bit weights, per 128 an fp16 scale and a 4-bit zero
        "gptq-int4-g128": (linears / 2 + linears / 128 * 2.5, head * 2, row * 2,
                           (norms + bias) * 2),
        "awq-int4-g128": (linears / 2 + linears / 128 * 2.5, head * 2, row * 2,
                          (norms + bias) * 2),
        # tinygemm: 4-bit weights, per 128 a bf16 scale and a bf16 zero
        "int4-g128": (linears / 2 + linears / 128 * 4, head * 2, row * 2, (norms + bias) * 2),
        # GGUF: F32 norms and biases; Q4_0 = 18 bytes per 32 weights; the head Q6_K = 210 bytes
        # per 256, or Q8_0 = 34 bytes per 32 where a row is not a multiple of 256 (tiny-qwen2)
        "gguf-bf16": (linears * 2, head * 2, row * 2, (norms + bias) * 4),
        "gguf-q4_0": (linears / 32 * 18, head / 256 * 210 if h % 256 == 0 else head / 32 * 34,
                      row / 32 * 18, (norms + bias) * 4),
    }[fmt]
    f = floor(resolve_model(name), lookup("h200"), 2048, weight_format=fmt)
    expected = linear_bytes + head_bytes + row_bytes + small_bytes
    assert f.weight_bytes == pytest.approx(expected, abs=1)
    assert f.kv_bytes == expected_kv_bytes(cfg, 2048)


def test_quantised_qwen_weights_shrink_as_the_layouts_say():
    # Qwen2.5-7B: 6.53 B linear weights; 4-bit layouts take about a quarter of their bytes.
    spec, h200 = resolve_model("qwen2.5-7b"), lookup("h200")
    bf16 = floor(spec, h200, 2048).weight_bytes
    gptq = floor(spec, h200, 2048, weight_format="gptq-int4-g128").weight_bytes
    assert 3.1 < bf16 / gptq < 3.2  # the 1.09 GB 16-bit LM head keeps it far from 3.85
