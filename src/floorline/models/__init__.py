from floorline.models.zoo import (
    ModelSpec,
    build_model,
    cache_keyword,
    resolve_model,
    shipped_models,
)

__all__ = ["ModelSpec", "build_model", "cache_keyword", "resolve_model", "shipped_models"]
