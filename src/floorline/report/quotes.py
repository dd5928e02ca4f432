"""How a figure is quoted: the median over every run of a cell that shares one provenance class
(the same GPU model, software and flags, and for the engine's paths its kernels and tuning
table), with its range and the number of runs, or said to be a single run. Documents quote
figures through generated blocks, which a check compares with what the data gives."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

from floorline.errors import FloorlineError
from floorline.measure.energy import energy_problem
from floorline.measure.fingerprint import fingerprint_key
from floorline.measure.steadiness import unsteady_reason
from floorline.paths import REGISTRY, parse_path
from floorline.paths.engine import EnginePath
from floorline.records import VALID
from floorline.store import CellRow


def provenance_class(row: CellRow) -> str:
    """The class a row belongs to: its environment's key where that includes the code's hashes
    (without the engine's kernels and tuning table for a path that does not run them); for a
    row from before provenance was recorded (its kernels unknown), its run's alone. A cell whose
    session rewound (measure/cell.py) timed a shorter cache than one that did not: apart."""
    if "code" not in row.fingerprint:
        klass = f"{row.fingerprint_key}, run {row.run_id}"
    elif runs_engine(row.path):
        klass = row.fingerprint_key
    else:
        klass = fingerprint_key(row.fingerprint, engine=False)
    rewound = row.details.get("rewound_every")
    return klass if rewound is None else f"{klass}, rewound every {rewound}"


def runs_engine(path: str) -> bool:
    """Whether a path runs the engine's kernels (an unknown path is taken to)."""
    try:
        return isinstance(REGISTRY[parse_path(path).base], EnginePath)
    except FloorlineError:
        return True


def ms(row: CellRow) -> float | None:
    return row.median_ms


def of_floor(row: CellRow) -> float | None:
    return row.fraction_of_floor


def joules_per_token(row: CellRow) -> float | None:
    """J/token where the reading is valid (measure/energy.py), else None."""
    e = row.details.get("energy")
    return e["joules_per_token"] if e and energy_problem(e) is None else None


@dataclass(frozen=True)
class Quote:
    value: float
    low: float
    high: float
    n: int
    ids: tuple[int, ...]  # the rows quoted
    klass: str

    def text(self, fmt: str, unit: str = "") -> str:
        """"3.87 ms (median of 5 runs, 3.82-3.87)", or "53.25 ms (one run)"."""
        value = f"{self.value:{fmt}}{unit}"
        if self.n == 1:
            return f"{value} (one run)"
        return f"{value} (median of {self.n} runs, {self.low:{fmt}}-{self.high:{fmt}})"


def one_class(runs: list[CellRow], klass: str | None = None) -> tuple[str, list[CellRow]]:
    """The runs of class `klass`, by default that of the newest run, with the class."""
    if klass is None:
        klass = provenance_class(max(runs, key=lambda r: r.id))
    return klass, [r for r in runs if provenance_class(r) == klass]


def steady(row: CellRow) -> bool:
    """Valid and steady by today's rule (measure/steadiness.py), which rows stored before it
    was made never met."""
    return row.status == VALID and unsteady_reason(
        row.details, {"median_ms": row.median_ms, "p10_ms": row.p10_ms,
                      "p90_ms": row.p90_ms}) is None


def quote(rows: list[CellRow], model: str, ctx: int, path: str,
          figure: Callable[[CellRow], float | None] = ms, klass: str | None = None) -> Quote | None:
    """`figure` of a cell over its runs in one class (`klass`; by default that of the newest
    steady run of the cell that has the figure); None where no steady run has it. An
    unsteady or invalid run is never quoted."""
    runs = [r for r in rows if (r.model, r.ctx, r.path) == (model, ctx, path) and steady(r)
            and figure(r) is not None]
    if not runs:
        return None
    klass, runs = one_class(runs, klass)
    if not runs:
        return None
    values = [figure(r) for r in runs]
    return Quote(median(values), min(values), max(values), len(values),
                 tuple(r.id for r in runs), klass)


BLOCK = re.compile(r"(<!-- quoted: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /quoted -->)", re.S)


def render(text: str, blocks: dict[str, str]) -> str:
    """`text` with each quoted block's body replaced by its generated text."""
    def fill(m):
        name = m.group("name")
        return m.group(1) + (blocks[name] if name in blocks else m.group("body")) + m.group(4)

    return BLOCK.sub(fill, text)


def mismatches(text: str, blocks: dict[str, str]) -> list[str]:
    """The quoted blocks of `text` whose body is not what the data gives, and the blocks
    generated that `text` does not hold."""
    found = {m.group("name"): m.group("body") for m in BLOCK.finditer(text)}
    wrong = [f"block '{name}' differs from the data" for name, body in found.items()
             if name in blocks and body != blocks[name]]
    return wrong + [f"block '{name}' is missing" for name in blocks if name not in found]
