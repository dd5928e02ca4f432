"""The engine on Qwen3, Gemma 3 and Phi-3 (Phi-4-mini) against transformers' own implementation of
the same configs and weights: tiny random configs that keep each family's features (q/k norms,
GeGLU, Gemma's four norms a layer and scaled embedding, sliding-window layers with their own
rotary base, linear and LongRoPE scaling, partial rotary embeddings, fused checkpoints)."""

import pytest
import torch
import transformers
from packaging.version import Version
from tests.conftest import KERNEL_DEVICE

from floorline.engine import Engine
from floorline.engine.check import compare_with_transformers
from floorline.engine.model import DecoderConfig, EngineUnsupported
from floorline.engine.weights import from_named, load_checkpoint
from floorline.models import build_model
from floorline.models.zoo import ModelSpec, _config_from_dict

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
            initializer_range=0.02, rms_norm_eps=1e-6)
PHI3 = dict(BASE, model_type="phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "qwen3": dict(BASE, model_type="qwen3", head_dim=32, tie_word_embeddings=True,
                  rope_theta=1e6),
    # head_dim 16 apart from hidden / heads, one kv head, an untied head
    "qwen3-mqa": dict(BASE, model_type="qwen3", head_dim=16, num_key_value_heads=1,
                      tie_word_embeddings=False),
    # two local layers (window 24, base 10^4) then a global one (base 10^6, linear factor 8):
    # 80 positions cross the window; the final logits soft-capped at 0.5, where the cap changes
    # these small random logits by percents
    "gemma3": dict(BASE, model_type="gemma3_text", head_dim=32, num_hidden_layers=3,
                   sliding_window=24, sliding_window_pattern=3, rope_theta=1e6,
                   rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   query_pre_attn_scalar=24, final_logit_softcapping=0.5),
    # Gemma 3 1B's shape of things: one kv head, no scaling, a window of 8 every other layer
    "gemma3-1b-like": dict(BASE, model_type="gemma3_text", head_dim=16, num_key_value_heads=1,
                           sliding_window=8, sliding_window_pattern=2),
    # half of each head turned; LongRoPE with an original length of 40, crossed while decoding
    "phi3-longrope": dict(PHI3, partial_rotary_factor=0.5, tie_word_embeddings=True,
                          original_max_position_embeddings=40,
                          rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7],
                                        "long_factor": [1.5, 2.0, 4.0, 8.0]}),
    # Phi-4-mini's 3/4 of the head turned; a prompt longer than the original length of 12,
    # which takes the long factors at every position
    "phi3-long-prompt": dict(PHI3, partial_rotary_factor=0.75, num_attention_heads=2,
                             original_max_position_embeddings=12,
                             rope_scaling={"type": "longrope", "short_factor": [1.0] * 12,
                                           "long_factor": [1.0 + i for i in range(12)]}),
}


def spec(name: str) -> ModelSpec:
    return ModelSpec(name, _config_from_dict(CONFIGS[name], name))


# (family, float32 max relative error, bf16 engine and transformers error against float32) as
# this file measured them, printed by -s for the record
@pytest.mark.parametrize("name", CONFIGS)
def test_float32_logits_equal_transformers_for_64_steps(name):
    result = compare_with_transformers(spec(name), "cpu", torch.float32, prompt_len=16, steps=64)
    print(f"\n{name} float32: max relative error {max(result.errors):.2e}")
    assert result.positions == 65 and result.argmax_agree == 65
    assert max(result.errors) < 1e-5


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3-longrope"])
def test_bf16_logits_stay_in_transformers_own_band(name):
    r = compare_with_transformers(spec(name), "cpu", torch.bfloat16, prompt_len=16,
                                  steps=64).summary()
    engine, hf = r["engine_vs_fp32_median"], r["hf_vs_fp32_median"]
    print(f"\n{name} bf16: engine {engine:.2e} (max {r['max_rel_err']:.2e} against transformers "
          f"bf16), transformers bf16 {hf:.2e}, against float32")
    assert 0 < engine < 2 * hf < 5e-2


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3-longrope"])
def test_the_kernels_decode_like_transformers(name):
    # the Triton kernels in the interpreter: steps at positions 22-25 cross the Gemma window of
    # 24
    result = compare_with_transformers(spec(name), KERNEL_DEVICE, torch.float32, prompt_len=22,
                                       steps=4, backend="triton")
    assert result.argmax_agree == result.positions == 5
    assert max(result.errors) < 1e-5


@pytest.mark.parametrize("name, weights, backend", [("phi3-longrope", "int4", "reference"),
                                                    ("gemma3", "fp8", "reference"),
                                                    ("gemma3", "int4", "triton")])
def test_quantised_weights_decode_like_transformers_on_them(name, weights, backend):
    # Phi-3's fused gate_up split in int4; Gemma's GeGLU in the int4 kernel
    steps = 64 if backend == "reference" else 2
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    r = compare_with_transformers(spec(name), device, torch.float32, prompt_len=16, steps=steps,
                                  weights=weights, group_size=32, backend=backend)
    assert r.argmax_agree == r.positions == steps + 1
    # the int4 kernel rounds x to 16-bit integers even in an fp32 run (1.8e-4 seen), against
    # 0.2 for the quantisation itself
    band = 1e-3 if backend == "triton" and weights == "int4" else 1e-4
    assert max(r.errors) < band and min(r.quant_vs_16bit) > 10 * band


def test_gemma_norms_fold_to_one_plus_w_and_layers_pick_their_rotary_base():
    config = DecoderConfig.from_hf(spec("gemma3").config)
    assert config.windows == (24, 24, None) and config.rotary == 32
    assert config.local_rope["rope_theta"] == 1e4 and config.rope["factor"] == 8.0
    hf = build_model(spec("gemma3"), "cpu", torch.float32)
    params = dict(hf.named_parameters())
    w = from_named(config, params.__getitem__, "cpu", torch.bfloat16)
    stored = params["model.layers.1.pre_feedforward_layernorm.weight"]
    assert w.layers[1].ln2.dtype == torch.float32 and torch.equal(w.layers[1].ln2, 1 + stored)
    engine = Engine(spec("gemma3"), "cpu", 16, dtype=torch.bfloat16, decoder_weights=w)
    assert engine.decoder.layer_rope == [1, 1, 0]
    assert engine.decoder.embed_scale == 8.0  # sqrt(64), exact in bf16


def test_fused_and_vision_language_checkpoints_load(tmp_path):
    from safetensors.torch import load_file, save_file

    for name, prefix in (("phi3-longrope", "model."), ("gemma3", "language_model.model.")):
        directory = tmp_path / name
        hf = build_model(spec(name), "cpu", torch.float32, seed=3)
        hf.save_pretrained(directory, safe_serialization=True)
        (shard,) = directory.glob("*.safetensors")
        # a vision-language checkpoint keeps its language model under a prefix
        tensors = {prefix + k.removeprefix("model."): v for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
        config = DecoderConfig.from_hf(spec(name).config)
        loaded = load_checkpoint(directory, config, "cpu", torch.float32)
        direct = from_named(config, dict(hf.named_parameters()).__getitem__, "cpu",
                            torch.float32)
        for a, b in zip(loaded.layers, direct.layers):
            for field in ("wqkv", "wgate", "wup", "wdown", "ln1", "ln2"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (name, field)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32}, "mixture-of-experts"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.1, "pad_token_id": 0}, "even number"),
    ({"model_type": "qwen3", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope type 'dynamic'"),
])
def test_what_the_engine_does_not_run_is_one_line(change, message):
    with pytest.raises(EngineUnsupported, match=message) as e:
        DecoderConfig.from_hf(_config_from_dict(dict(BASE, **change), "cfg"))
    assert "\n" not in str(e.value)


def vision_language(text: dict) -> dict:
    """A Gemma 3 vision-language config around a text config (a tiny SigLIP tower)."""
    vocab = text["vocab_size"]
    return dict(model_type="gemma3", text_config=text, mm_tokens_per_image=4,
                boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1,
                vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14))


def test_a_vision_language_checkpoint_is_floored_by_its_language_model():
    from floorline.traffic import count_parameters

    text = dict(CONFIGS["gemma3"], vocab_size=259)
    whole = ModelSpec("vl", _config_from_dict(vision_language(text), "vl"))
    alone = ModelSpec("text", _config_from_dict(text, "text"))
    assert count_parameters(whole) == count_parameters(alone)


# transformers 5.17 generates otherwise once a reply crosses LongRoPE's original length (its
# tokens part from 5.25's there, on the same checkpoint); the engine follows 5.25
CROSSING_AS_5_25 = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.25"),
    reason=f"transformers {transformers.__version__} generates otherwise across LongRoPE's "
           "original length than 5.25, which the engine follows")


@pytest.mark.parametrize("name", ["gemma3", pytest.param("phi3-longrope",
                                                         marks=CROSSING_AS_5_25)])
def test_generate_runs_a_checkpoint_as_transformers_does(tmp_path, name):
    # Gemma 3 as a vision-language checkpoint (its language model under language_model.*),
    # Phi-3 with a LongRoPE original length of 8 that the prompt and the reply cross
    from tests.test_generate import EOS, PROMPT, WORDS, word_tokenizer
    from transformers import AutoModelForCausalLM

    from floorline.engine.generate import generate

    text = dict(CONFIGS[name], vocab_size=len(WORDS) + 3, eos_token_id=EOS, bos_token_id=None,
                pad_token_id=0, initializer_range=0.1)
    if name == "phi3-longrope":
        text["original_max_position_embeddings"] = 8
    data = vision_language(text) if name == "gemma3" else text
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config_from_dict(data, name)).float().save_pretrained(
        tmp_path, safe_serialization=True)
    word_tokenizer().save_pretrained(tmp_path)
    result = generate(tmp_path, PROMPT, max_new_tokens=12, device="cpu", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([result.prompt_ids])
    theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=12, pad_token_id=EOS)[0, ids.shape[1]:].tolist()
    assert result.ids == theirs[:len(result.ids)] and len(result.ids) >= 4
