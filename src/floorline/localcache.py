"""floorline's cache directory: written GGUF files, kernel tuning tables."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("FLOORLINE_CACHE", "~/.cache/floorline")).expanduser()
