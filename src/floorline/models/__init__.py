from floorline.models.zoo import (
    ModelSpec,
    build_model,
    cache_keyword,
    cut_down,
    model_label,
    no_tensor,
    resolve_model,
    safetensors_files,
    shipped_models,
)

__all__ = ["ModelSpec", "build_model", "cache_keyword", "cut_down", "model_label", "no_tensor",
           "resolve_model", "safetensors_files", "shipped_models"]
