"""The study's published figures (study.json): fractions of the floor, quantised ms/step and A/B
speedups, as the reference series the report draws and the forecast is checked against."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

STUDY_FILE = Path(__file__).with_name("study.json")


@cache
def study() -> dict:
    return json.loads(STUDY_FILE.read_text())
