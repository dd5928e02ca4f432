"""A grid of cells, measured one by one into the results database, resumable; the quality of
each (model, path) of the grid whose model has real weights; and speculative decoding on
workloads (measure/speculation.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import product

from floorline.hardware import DeviceSpec
from floorline.measure.fingerprint import environment, fingerprint_key
from floorline.measure.quality import quality_key
from floorline.measure.runner import TIMEOUT_S, run_cell_in_child, run_quality_in_child
from floorline.measure.speculation import run_speculation_in_child
from floorline.models import resolve_model
from floorline.models.fetch import fetched_dir
from floorline.models.zoo import DEMO_MODEL, DEMO_MODELS, STUDY_MODELS
from floorline.paths import REGISTRY, parse_path
from floorline.records import (
    SAME_QUALITY,
    UNSTEADY,
    CellKey,
    CellResult,
    QualityKey,
    QualityResult,
    SpeculationKey,
    SpeculationResult,
)
from floorline.store import CellRow, QualityRow, SpeculationRow, Store

STUDY_CONTEXTS = (2048, 4096, 8192, 16384)
DEMO_CONTEXTS = (128, 512)
DEMO_PATHS = ("hf-eager", "hf-static", "engine")
# the trained model's own GGUF file as stored: the engine's, and llama.cpp's where it is installed
DEMO_FILE_PATHS = ("engine-gguf", "llamacpp-q4_1")


@dataclass(frozen=True)
class Grid:
    models: tuple[str, ...]
    contexts: tuple[int, ...]
    paths: tuple[str, ...]

    def cells(self, steps: int | str, warmup: int | str) -> list[CellKey]:
        return [CellKey(m, c, p, steps, warmup)
                for m, c, p in product(self.models, self.contexts, self.paths)]

    def quality(self, tokens: int, window: int, trust_remote_code: bool) -> list[QualityKey]:
        """One quality measurement per model with real weights and base path (not per context:
        quality is the formats', and +compile and +graphs change no arithmetic), a path that
        shares another's quality measured as that one (records.SAME_QUALITY)."""
        bases = dict.fromkeys(SAME_QUALITY.get(b, b) for b in
                              (parse_path(p).base for p in self.paths))
        return [quality_key(m, p, tokens, window) for m in self.models
                if resolve_model(m, trust_remote_code).has_real_weights for p in bases]


def default_grid(device: str) -> Grid:
    """The study's grid on a GPU; elsewhere the CPU demo through the same pipeline: the trained
    model where it has been fetched (`floorline models fetch`), its GGUF file as stored beside
    the checkpoint, else the tiny configs."""
    if device.startswith("cuda"):
        return Grid(STUDY_MODELS, STUDY_CONTEXTS, ("hf-eager",))
    if fetched_dir(DEMO_MODEL) is not None:
        return Grid((DEMO_MODEL,), DEMO_CONTEXTS, DEMO_PATHS + tuple(
            p for p in DEMO_FILE_PATHS if REGISTRY[p].unavailable(device) is None))
    return Grid(DEMO_MODELS, DEMO_CONTEXTS, DEMO_PATHS)


def check_grid(grid: Grid, trust_remote_code: bool) -> Grid:
    """Fail before measuring anything on a name that can never run; paths in canonical form."""
    for model in grid.models:
        resolve_model(model, trust_remote_code)
    return Grid(grid.models, grid.contexts, tuple(parse_path(p).name for p in grid.paths))


def stored_cells(store: Store, keys: list[CellKey], env_keys: set[str]) -> list[CellRow]:
    """The rows of the cells `keys` stored under one of the environments `env_keys` (a sweep's
    here, or its fleet's workers')."""
    wanted = {(k.model, k.ctx, k.path, k.steps, k.warmup) for k in keys}
    return [r for r in store.rows() if r.fingerprint_key in env_keys
            and (r.model, r.ctx, r.path, r.steps, r.warmup) in wanted]


def run_each(keys: list, run: Callable, on_start: Callable | None,
             on_done: Callable | None) -> int:
    """`run(key)` for each of `keys` in order, `on_start(key)` before it and `on_done(key,
    result)` after; how many ran (were not skipped: a result other than None)."""
    ran = 0
    for key in keys:
        if on_start:
            on_start(key)
        result = run(key)
        ran += result is not None
        if on_done:
            on_done(key, result)
    return ran


class Sweep:
    """Measures cells, quality and speculation into `store`, each in a fresh process
    (measure/runner.py), skipping those already valid under this environment."""

    def __init__(self, store: Store, device: str, gpu: DeviceSpec, *, force: bool = False,
                 seed: int = 0, trust_remote_code: bool = False, timeout_s: float = TIMEOUT_S):
        self.store, self.device, self.gpu = store, device, gpu
        self.force, self.seed, self.trust_remote_code = force, seed, trust_remote_code
        self.timeout_s = timeout_s
        self.env = environment(device)
        self.env_key = fingerprint_key(self.env)

    def begin_run(self, command: str, options: dict, label: str | None) -> None:
        """This invocation begun as a run of the database, in this sweep's environment."""
        self.store.begin_run(command, options, self.env, self.env_key, label)

    def run_cell(self, key: CellKey, earlier: CellResult | None = None) -> CellResult | None:
        """The cell, committed to the database as soon as it ends; None when skipped.
        `earlier`: the unsteady attempt this one measures again, named in its details."""
        if not self.force and earlier is None and self.store.has_valid(key, self.env_key):
            return None
        result = run_cell_in_child(key, self.device, self.gpu, self.seed,
                                   self.trust_remote_code, self.timeout_s)
        if earlier is not None:
            result.measured_again_after(earlier)
        self.store.add(result, self.env, self.env_key)
        return result

    def run_quality(self, key: QualityKey) -> QualityResult | None:
        """The path's quality, committed as soon as it ends; None when already valid."""
        if not self.force and self.store.has_valid_quality(key, self.gpu.name, self.env_key):
            return None
        result = run_quality_in_child(key, self.device, self.gpu, self.seed,
                                      self.trust_remote_code, self.timeout_s)
        self.store.add_quality(result, self.env, self.env_key)
        return result

    def run_speculation(self, key: SpeculationKey) -> SpeculationResult | None:
        """Speculation on one workload, committed as soon as it ends; None when already
        valid."""
        if not self.force and self.store.has_valid_speculation(key, self.gpu.name,
                                                               self.env_key):
            return None
        result = run_speculation_in_child(key, self.device, self.gpu, self.trust_remote_code,
                                          self.timeout_s)
        self.store.add_speculation(result, self.env, self.env_key)
        return result

    def run_cells(self, keys: list[CellKey],
                  on_start: Callable[[CellKey], None] | None = None,
                  on_done: Callable[[CellKey, CellResult | None], None] | None = None,
                  on_again: Callable[[int], None] | None = None) -> int:
        """Every cell of `keys` in order (run_cell), `on_start(key)` before each and
        `on_done(key, its result or None where skipped)` after; how many were measured. Then each
        cell found unsteady is measured once more, after all the others (`on_again(how many)`
        first, and the callbacks as before): what disturbs a host (another process, a slow spell
        of its CPU, files written back to disk) seldom lasts a whole sweep. Both attempts are
        kept; the later is the cell's newest row."""
        unsteady: list[tuple[CellKey, CellResult]] = []

        def first(key: CellKey) -> CellResult | None:
            result = self.run_cell(key)
            if result is not None and result.status == UNSTEADY:
                unsteady.append((key, result))
            return result
        measured = run_each(keys, first, on_start, on_done)
        if unsteady and on_again:
            on_again(len(unsteady))
        again = dict(unsteady)
        run_each(list(again), lambda key: self.run_cell(key, again[key]), on_start, on_done)
        return measured

    def run_qualities(self, keys: list[QualityKey],
                      on_start: Callable[[QualityKey], None] | None = None,
                      on_done: Callable[[QualityKey, QualityResult | None], None] | None = None
                      ) -> int:
        """Every quality of `keys` in order (run_quality), as run_cells; how many were
        measured."""
        return run_each(keys, self.run_quality, on_start, on_done)

    def cells(self, keys: list[CellKey]) -> list[CellRow]:
        """The stored rows of the cells `keys` measured in this environment."""
        return stored_cells(self.store, keys, {self.env_key})

    def speculations(self, keys: list[SpeculationKey]) -> list[SpeculationRow]:
        """The speculation rows of `keys` stored in this environment on this sweep's GPU."""
        wanted = set(keys)
        return [r for r in self.store.speculation_rows() if r.fingerprint_key == self.env_key
                and r.gpu == self.gpu.name and r.key in wanted]

    def qualities(self, keys: list[QualityKey] | None = None) -> list[QualityRow]:
        """The quality rows stored in this environment; given `keys`, only theirs on this
        sweep's GPU."""
        rows = [q for q in self.store.quality_rows() if q.fingerprint_key == self.env_key]
        if keys is None:
            return rows
        wanted = {(k.model, k.path, k.text, k.tokens, k.window) for k in keys}
        return [q for q in rows if q.gpu == self.gpu.name
                and (q.model, q.path, q.text_sha256, q.tokens, q.window) in wanted]
