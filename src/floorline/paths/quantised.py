"""What the weight-only quantised paths share: transformers' StaticCache decode with the
decoder's linear layers swapped for a library's quantised ones.

The LM head and the embeddings stay in the model's 16-bit dtype, as the checkpoints of these
formats ship them. The step is the `hf-static` step, so +graphs and +compile apply wherever the
library's kernels allow them, and `hf-static` with the same options is the bf16 reference that a
quantised cell's realised reduction is measured against.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from abc import abstractmethod

from floorline.errors import FloorlineError
from floorline.models import build_model
from floorline.models.zoo import quantisation_config
from floorline.paths.base import PathFacts
from floorline.paths.hf import HFPath


def library_missing(module: str, distribution: str, extra: str) -> str | None:
    """Why a path cannot run because its library is absent, with what to install; or None."""
    if importlib.util.find_spec(module) is None:
        return f"{distribution} is not installed (pip install 'floorline[{extra}]')"
    return None


def library_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def replace_linears(hf_model, make) -> int:
    """Replaces every nn.Linear of the decoder (not the LM head) by `make(name, linear)`, one at
    a time so that the 16-bit copy of each is freed as its replacement is made."""
    import torch

    head = hf_model.get_output_embeddings()
    targets = [(name, module) for name, module in hf_model.named_modules()
               if isinstance(module, torch.nn.Linear) and module is not head]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = hf_model.get_submodule(parent_name) if parent_name else hf_model
        setattr(parent, child, make(name, linear))
    return len(targets)


class QuantisedHFPath(HFPath):
    """A transformers path on a static cache whose linears run a library's quantised kernels."""

    cache_kind = "static"

    def __init__(self, facts: PathFacts):
        self.facts = facts

    def unavailable(self, device: str) -> str | None:
        lib = self.facts.library
        missing = lib.module and library_missing(lib.module, lib.distribution, lib.extra)
        if missing:
            return missing
        if self.facts.cuda_only and not device.startswith("cuda"):
            return f"{lib.distribution}'s kernels for this format run on CUDA only"
        return None

    def versions(self) -> dict:
        distribution = self.facts.library.distribution
        return {distribution: library_version(distribution)}


class QuantisingHFPath(QuantisedHFPath):
    """16-bit weights (random or a checkpoint's) quantised by the library's own quantiser."""

    def build(self, model_spec, device: str, seed: int):
        if quantisation_config(model_spec.config) is not None:
            raise FloorlineError(f"{model_spec.name} is a pre-quantised checkpoint; {self.name} "
                                 "quantises 16-bit weights itself")
        hf_model = super().build(model_spec, device, seed)
        self.quantise(hf_model, device)
        return hf_model

    @abstractmethod
    def quantise(self, hf_model, device: str) -> None:
        """Swaps the decoder's linears for quantised ones."""


class PackedHFPath(QuantisedHFPath):
    """A pre-quantised int4 layout (GPTQ, AWQ) run by a library's kernels: random tensors drawn
    directly in the layout, or a local checkpoint of that format loaded as it is. The model runs
    in fp16, as these checkpoints ship."""

    layout = None  # floorline.layouts.gptq or .awq
    quant_method: str  # quantization_config.quant_method of the checkpoints
    group_size = 128

    @abstractmethod
    def make_linear(self, tensors: dict, bias, device: str, shared: dict):
        """The library's linear for one layer's packed tensors (and 16-bit bias, or None);
        `shared` is one dict per model, for buffers its layers share."""

    def check_checkpoint(self, qc: dict, name: str) -> None:
        if qc.get("quant_method") != self.quant_method or qc.get("bits") != 4 \
                or qc.get("group_size") != self.group_size:
            raise FloorlineError(
                f"{name} is not a {self.quant_method} int4 group-{self.group_size} checkpoint "
                f"(quantization_config: {qc})")

    def build(self, model_spec, device: str, seed: int):
        import torch

        qc = quantisation_config(model_spec.config)
        if model_spec.has_real_weights and qc is None:
            raise FloorlineError(f"{model_spec.name} holds 16-bit weights; {self.name} runs "
                                 f"{self.quant_method} checkpoints (or random weights by name)")
        if qc is not None:
            self.check_checkpoint(qc, model_spec.name)
        # The skeleton's 16-bit weights are random; the packed ones replace the linears, and a
        # checkpoint's own tensors replace the rest.
        hf_model = build_model(model_spec.without_weights(), device,
                               getattr(torch, self.facts.dtype), seed)
        shared = {}
        if not model_spec.has_real_weights:
            generator = torch.Generator(device).manual_seed(seed)

            def make(name, linear):
                tensors = self.layout.random(linear.out_features, linear.in_features,
                                             self.group_size, generator, device)
                return self.make_linear(tensors, linear.bias, device, shared)

            replace_linears(hf_model, make)
            return hf_model
        load_packed_checkpoint(hf_model, model_spec.weights_dir, self.layout.TENSORS,
                               lambda tensors, bias: self.make_linear(tensors, bias, device,
                                                                      shared),
                               device)
        return hf_model


def load_packed_checkpoint(hf_model, directory, tensor_names, make, device: str) -> None:
    """Loads a packed checkpoint (safetensors) into `hf_model`: each decoder linear becomes
    `make(tensors, bias)` from its packed tensors, every other tensor is copied in place."""
    import torch
    from safetensors import safe_open

    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            files.update({key: path for key in f.keys()})

    def tensor(key):
        with safe_open(str(files[key]), framework="pt", device=str(device)) as f:
            return f.get_tensor(key)

    used = set()

    def make_linear(name, linear):
        keys = [f"{name}.{t}" for t in tensor_names]
        missing = [k for k in keys if k not in files]
        if missing:
            raise FloorlineError(f"{directory}: no {missing[0]} for linear layer {name}")
        bias_key = f"{name}.bias"
        bias = tensor(bias_key).to(torch.float16) if bias_key in files else None
        used.update(keys + [bias_key])
        return make({t: tensor(k) for t, k in zip(tensor_names, keys)}, bias)

    replace_linears(hf_model, make_linear)
    state = hf_model.state_dict()
    for key, target in state.items():
        if key in used:
            continue
        if key in files:
            target.copy_(tensor(key))
            used.add(key)
        elif key.endswith(".weight") or key.endswith(".bias"):
            tied = hf_model.config.get_text_config().tie_word_embeddings
            if not (tied and key == "lm_head.weight"):
                raise FloorlineError(f"{directory}: the checkpoint has no tensor {key}")
