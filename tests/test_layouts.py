"""The int4 layouts (GPTQ, AWQ) against their definitions: bit positions, round trips on random
data, dequantisation, and a packed checkpoint loaded through the same code the GPU paths use."""

import json

import pytest
import torch
from safetensors.torch import save_file

from floorline.layouts import awq, gptq
from floorline.layouts.int4 import pack_int4, random_groups, unpack_int4
from floorline.models import build_model, resolve_model
from floorline.paths.base import Library, PathFacts
from floorline.paths.quantised import PackedHFPath


def test_gptq_bits_are_where_autogptq_puts_them():
    # Input rows 0..7 of output column 0 hold 0..7: one word, lowest row in the lowest nibble.
    q = torch.zeros(8, 16, dtype=torch.int64)
    q[0, :8] = torch.arange(8)
    q[0, 8:] = torch.arange(8, 16)
    zeros = torch.full((1, 8), 8)
    zeros[0, 1] = 1
    t = gptq.pack(q, zeros, torch.ones(1, 8), group_size=128)
    assert t["qweight"].shape == (2, 8) and t["qweight"].dtype == torch.int32
    assert t["qweight"][0, 0].item() == 0x76543210
    assert t["qweight"][1, 0].item() & 0xFFFFFFFF == 0xFEDCBA98
    # zero - 1 stored: 7 everywhere but column 1, which stores 0.
    assert t["qzeros"].item() & 0xFFFFFFFF == 0x77777707
    assert t["g_idx"].tolist() == [0] * 16


def test_awq_interleaves_output_columns():
    # Output columns 0..7 of input row 0 hold 0..7; AWQ puts column order[j] in nibble j.
    q = torch.zeros(8, 128, dtype=torch.int64)
    q[:, 0] = torch.arange(8)
    t = awq.pack(q, torch.zeros(1, 8, dtype=torch.int64), torch.ones(1, 8), group_size=128)
    assert t["qweight"].shape == (128, 1)
    word = t["qweight"][0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("layout", [gptq, awq])
@pytest.mark.parametrize("shape", [(64, 256), (512, 384), (24, 128)])
def test_round_trip_and_dequantisation(layout, shape):
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f + in_f)
    q, zeros, scales = random_groups(out_f, in_f, 128, g, "cpu")
    t = layout.pack(q, zeros, scales, 128)
    q2, zeros2 = layout.unpack(t)
    assert torch.equal(q2, q) and torch.equal(zeros2, zeros)
    w = layout.dequantise(t, 128).float()
    for o, i in [(0, 0), (out_f - 1, in_f - 1), (out_f // 2, 130 % in_f)]:
        grp = i // 128
        assert w[o, i] == ((q[o, i] - zeros[grp, o]) * scales[grp, o].float()).half().float()
    # Drawn like a trained layer: mean ~0, std ~0.02, never all zeros.
    assert abs(w.mean()) < 2e-3 and 0.017 < w.std() < 0.023


def test_pack_refuses_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((8, 1), 16), dim=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(6, 1), dim=0)
    with pytest.raises(ValueError, match="1..16"):
        gptq.pack(torch.zeros(8, 128), torch.zeros(1, 8), torch.ones(1, 8), 128)


@pytest.mark.parametrize("dim", [0, 1])
def test_unpack_inverts_pack_on_any_dimension(dim):
    v = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(dim))
    assert torch.equal(unpack_int4(pack_int4(v, dim), dim), v)


class DequantisedLinear(torch.nn.Module):
    """The layout's reference: the weight it holds, dequantised, in a plain matmul."""

    def __init__(self, layout, tensors, bias):
        super().__init__()
        self.weight = layout.dequantise(tensors, 128)
        self.bias = bias

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


class ReferencePacked(PackedHFPath):
    layout, quant_method = gptq, "gptq"

    def __init__(self):
        super().__init__(PathFacts("reference-gptq", kv_dtype="fp16", reference="hf-static",
                                   dtype="float16", library=Library("torch", "torch", "-"),
                                   cuda_only=True))

    def make_linear(self, tensors, bias, device, shared):
        return DequantisedLinear(self.layout, tensors, bias)


def write_gptq_checkpoint(directory, model_name):
    """A random tiny model saved as a GPTQ checkpoint: packed linears, fp16 everything else."""
    spec = resolve_model(model_name)
    dense = build_model(spec, "cpu", torch.float16, seed=4)
    tensors, g = {}, torch.Generator().manual_seed(9)
    head = dense.get_output_embeddings()
    for name, m in dense.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            for k, v in gptq.random(m.out_features, m.in_features, 128, g, "cpu").items():
                tensors[f"{name}.{k}"] = v
            if m.bias is not None:
                tensors[f"{name}.bias"] = m.bias.detach().clone()
    for k, v in dense.state_dict().items():
        if not any(k.startswith(p) for p in {n.rsplit(".", 1)[0] for n in tensors}):
            tensors[k] = v.clone()
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    config = spec.config.to_dict()
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                     "desc_act": False, "sym": False}
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen2"])
def test_a_packed_checkpoint_is_loaded_as_it_is(tmp_path, model_name):
    tensors = write_gptq_checkpoint(tmp_path / "ckpt", model_name)
    spec = resolve_model(str(tmp_path / "ckpt"))
    model = ReferencePacked().build(spec, "cpu", seed=0)
    q_proj = model.model.layers[1].self_attn.q_proj
    prefix = "model.layers.1.self_attn.q_proj"
    expected = gptq.dequantise({k: tensors[f"{prefix}.{k}"] for k in gptq.TENSORS}, 128)
    assert torch.equal(q_proj.weight, expected)
    if model_name == "tiny-qwen2":  # Qwen2's q/k/v bias comes from the checkpoint too
        assert torch.equal(q_proj.bias, tensors[f"{prefix}.bias"])
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_random_packed_weights_and_wrong_checkpoints(tmp_path):
    model = ReferencePacked().build(resolve_model("tiny-llama"), "cpu", seed=0)
    w = model.model.layers[0].mlp.down_proj.weight.float()
    assert 0.017 < w.std() < 0.023
    write_gptq_checkpoint(tmp_path / "ckpt", "tiny-llama")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    from floorline.errors import FloorlineError

    with pytest.raises(FloorlineError, match="not a gptq int4 group-128 checkpoint"):
        ReferencePacked().build(resolve_model(str(tmp_path / "ckpt")), "cpu", seed=0)


def test_marlin_permutations_follow_vllms_definition():
    # vLLM marlin_utils: within each 64 columns, position 8i + j holds column i + 8j (an 8x8
    # transpose); zero points then interleave each 8 as [0, 2, 4, 6, 1, 3, 5, 7] and pack eight
    # to a word, nibble j holding the j-th. Checked element by element against that statement.
    from floorline.paths.awq_marlin import marlin_scales, marlin_zero_points

    n = 128
    cols = torch.arange(n).repeat(3, 1)
    permuted = marlin_scales(cols)
    for p in range(n):
        block, within = divmod(p, 64)
        i, j = divmod(within, 8)
        assert permuted[0, p] == block * 64 + i + 8 * j
    zeros = torch.randint(0, 16, (3, n), generator=torch.Generator().manual_seed(0))
    words = marlin_zero_points(zeros)
    assert words.shape == (3, n // 8) and words.dtype == torch.int32
    for g in range(3):
        for c in range(n // 8):
            for j in range(8):
                q = 8 * c + (0, 2, 4, 6, 1, 3, 5, 7)[j]
                block, within = divmod(q, 64)
                col = block * 64 + within // 8 + 8 * (within % 8)
                assert (words[g, c].item() >> (4 * j)) & 0xF == zeros[g, col]
