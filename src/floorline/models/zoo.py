"""Model names and local directories -> configs; configs -> random or real weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from floorline.errors import FloorlineError

CONFIG_DIR = Path(__file__).parent / "configs"

# Where each shipped config.json was copied from (the Hugging Face repository of the model).
SOURCES = {
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b-v0.3": "mistralai/Mistral-7B-v0.3",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "tiny-llama": "floorline test config (Llama architecture)",
    "tiny-qwen2": "floorline test config (Qwen2, tied embeddings, q/k/v bias)",
    "tiny-mistral-swa": "floorline test config (Mistral, 256-token sliding window)",
}

STUDY_MODELS = ("qwen2.5-7b", "llama-3.1-8b", "mistral-7b-v0.3")
DEMO_MODELS = ("tiny-llama", "tiny-qwen2")


@dataclass(frozen=True)
class ModelSpec:
    """What a path needs to build a model: a name, its config, and real weights if any."""

    name: str
    config: object = field(compare=False)  # transformers.PreTrainedConfig; keyed by name
    weights_dir: Path | None = None
    trust_remote_code: bool = False

    @property
    def max_context(self) -> int | None:
        return getattr(self.config.get_text_config(), "max_position_embeddings", None)

    @property
    def has_real_weights(self) -> bool:
        return self.weights_dir is not None

    def without_weights(self) -> "ModelSpec":
        """The same architecture with seeded random weights."""
        return replace(self, weights_dir=None)


def quantisation_config(config) -> dict | None:
    """A transformers config's quantization_config as a dict (the text model's or the
    top-level one), or None for a 16-bit checkpoint."""
    qc = (getattr(config.get_text_config(), "quantization_config", None)
          or getattr(config, "quantization_config", None))
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return qc


def shipped_models() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _read_config_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FloorlineError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except OSError as e:
        raise FloorlineError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise FloorlineError(f"{path} has no 'model_type': not a Hugging Face config.json")
    return data


def _config_from_dict(data: dict, origin: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as e:
        raise FloorlineError(f"{origin}: transformers cannot build this config ({e})") from None


@cache
def resolve_model(name_or_dir: str, trust_remote_code: bool = False) -> ModelSpec:
    """A shipped name (see `floorline models`) or a local directory holding config.json."""
    if name_or_dir in SOURCES:
        path = CONFIG_DIR / f"{name_or_dir}.json"
        return ModelSpec(name_or_dir, _config_from_dict(_read_config_json(path), name_or_dir))
    directory = Path(name_or_dir).expanduser()
    if not directory.is_dir():
        raise FloorlineError(
            f"unknown model '{name_or_dir}': not a shipped name ({', '.join(shipped_models())}) "
            "nor a directory"
        )
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FloorlineError(f"{directory} has no config.json")
    data = _read_config_json(config_path)
    if data.get("auto_map") and not trust_remote_code:
        raise FloorlineError(
            f"{config_path} asks for remote model code (auto_map); pass --trust-remote-code to run it"
        )
    if trust_remote_code:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    else:
        config = _config_from_dict(data, str(config_path))
    weights = directory if any(directory.glob("*.safetensors")) else None
    return ModelSpec(str(directory), config, weights, trust_remote_code)


def build_model(spec: ModelSpec, device: str, dtype, seed: int = 0):
    """The model on `device`, in eval mode: real weights from safetensors, or seeded random ones.

    Random weights are drawn on the target device itself (building a 7B model on the CPU first
    takes minutes) by the architecture's own initialiser: normal(0, initializer_range) for the
    matrices, never all zeros.
    """
    import torch
    from transformers import AutoModelForCausalLM

    common = dict(dtype=dtype, attn_implementation="sdpa", trust_remote_code=spec.trust_remote_code)
    if spec.has_real_weights:
        model = AutoModelForCausalLM.from_pretrained(
            spec.weights_dir, device_map=device, use_safetensors=True, **common
        )
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(spec.config, **common)
    return model.eval().requires_grad_(False)
