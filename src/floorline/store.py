"""The results database: one SQLite row per measured cell, committed as each cell ends; one
per quality measurement of a model and path (the quality table); one per speculative decoding
measurement of a model, drafter and workload (the speculation table). Each invocation that
measures (sweep, quality, speculate, ab, explain, probe) is a run (the runs table: its command
line, every resolved option, its provenance, when it started and ended) and every row it writes
points at it (run_id).

WAL journalling and a long busy timeout let several sweeps write one file at once; a cell is
one INSERT in its own transaction, so a run killed at any point keeps every finished cell.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import sys
from dataclasses import asdict, astuple, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

from floorline.errors import FloorlineError
from floorline.records import (
    QUALITY_FIGURES,
    SAME_QUALITY,
    SPECULATION_FIGURES,
    VALID,
    CellKey,
    CellResult,
    QualityKey,
    QualityResult,
    SpeculationKey,
    SpeculationResult,
)

# 2: A/B experiments, card probes, explanations; 3: quality; 4: runs; 5: speculation; 6: an A/B
# session's warm-up and energy (ab_sessions.details), so that a cut-off A/B can be resumed whole
SCHEMA_VERSION = 6
# An A/B session's fields kept in ab_sessions.details (measure/ab.py's SessionResult).
SESSION_DETAILS = ("warmup_steps", "energy_a", "energy_b", "energy_note")
# The tables whose rows point at the run that wrote them (schema 4 added the column to each).
RUN_TABLES = ("cells", "quality", "ab_experiments", "explanations", "probes", "speculation")


def column(sql: str, json_kind: type | None = None, **default):
    """A field of a row class (CellRow, QualityRow, SpeculationRow) that is a column of its
    table: its SQL type and constraints, and for a JSON column the kind of value it holds."""
    return field(metadata={"sql": sql, "json": json_kind}, **default)


def host_layers(probes: list[dict]) -> list[dict]:
    """The host's layer times in `probes` (oldest first; measure.probe.host_layer's figures,
    those read), each with its `path`: the newest of each path and architecture."""
    found = {}
    for results in probes:
        for path, host in (results.get("host_layer") or {}).items():
            if "layer_us" in host:
                found[path, host["architecture"]] = {**host, "path": path}
    return list(found.values())


class StoredRow:
    """A row class whose fields, in order, are its table's columns, the id first."""

    def as_dict(self) -> dict:
        return asdict(self)

    def stored(self) -> dict:
        """The row's values as the database holds them, JSON columns encoded (without its id,
        which the database assigns)."""
        out = {}
        for c in fields(self)[1:]:
            value = getattr(self, c.name)
            out[c.name] = (json.dumps(value, sort_keys=c.metadata["json"] is dict)
                           if c.metadata["json"] else value)
        return out


@dataclass(kw_only=True)
class CellRow(StoredRow):
    """One row of the cells table: a measured cell, its floor and the environment that measured
    it. Its fields, in order, are the table's columns (the schema and every insert come from
    them)."""
    id: int | None = column("INTEGER PRIMARY KEY")  # None until stored
    model: str = column("TEXT NOT NULL")
    ctx: int = column("INTEGER NOT NULL")
    path: str = column("TEXT NOT NULL")
    steps: int | str = column("INTEGER NOT NULL")  # or the automatic rule, "auto:<width>"
    warmup: int | str = column("INTEGER NOT NULL")  # or "auto"
    gpu: str = column("TEXT NOT NULL")
    status: str = column("TEXT NOT NULL")
    reason: str | None = column("TEXT", default=None)
    median_ms: float | None = column("REAL", default=None)
    p10_ms: float | None = column("REAL", default=None)
    p90_ms: float | None = column("REAL", default=None)
    mean_ms: float | None = column("REAL", default=None)
    floor_ms: float | None = column("REAL", default=None)
    floor_ms_all_params: float | None = column("REAL", default=None)
    fraction_of_floor: float | None = column("REAL", default=None)
    achieved_gbps: float | None = column("REAL", default=None)
    weight_bytes: int | None = column("INTEGER", default=None)
    kv_bytes: int | None = column("INTEGER", default=None)
    total_bytes: int | None = column("INTEGER", default=None)
    peak_gbps: float | None = column("REAL", default=None)
    weight_format: str | None = column("TEXT", default=None)
    kv_dtype: str | None = column("TEXT", default=None)
    # every timed step
    samples_ms: list[float] = column("TEXT NOT NULL", list, default_factory=list)
    fingerprint_key: str = column("TEXT NOT NULL")
    # versions, device, driver, clocks
    fingerprint: dict = column("TEXT NOT NULL", dict, default_factory=dict)
    # seed, device, peak source, compile mode ...
    details: dict = column("TEXT NOT NULL", dict, default_factory=dict)
    finished_at: str = column("TEXT NOT NULL")
    run_id: int | None = column("INTEGER", default=None)  # None: measured before runs were kept

    @classmethod
    def of(cls, cell: CellResult, env: dict, env_key: str) -> CellRow:
        """The row that stores `cell`, measured in environment `env` (keyed `env_key`)."""
        s, f = cell.summary or {}, cell.floor or {}
        return cls(
            id=None,
            **{k: getattr(cell.key, k) for k in ("model", "ctx", "path", "steps", "warmup")},
            gpu=cell.gpu, status=cell.status, reason=cell.reason,
            **{k: s.get(k) for k in ("median_ms", "p10_ms", "p90_ms", "mean_ms")},
            **{k: f.get(k) for k in ("floor_ms", "floor_ms_all_params", "weight_bytes",
                                     "kv_bytes", "total_bytes", "peak_gbps", "weight_format",
                                     "kv_dtype")},
            fraction_of_floor=cell.fraction_of_floor, achieved_gbps=cell.achieved_gbps,
            samples_ms=cell.samples_ms, fingerprint_key=env_key, fingerprint=env,
            details=cell.details, finished_at=now())

    def fraction_of_measured(self, probes: dict[str, dict]) -> float | None:
        """The fraction of the floor reached at the streaming-read bandwidth of the newest probe
        of this row's environment (`probes`: Store.probes()); None where there is none."""
        read = probes.get(self.fingerprint_key, {}).get("stream_read_gbps")
        return self.total_bytes / (read * 1e6) / self.median_ms if read and self.median_ms else None


@dataclass(kw_only=True)
class QualityRow(StoredRow):
    """One row of the quality table: what a path's formats cost in quality on one model with
    real weights, against transformers' own model of the same weights in float32
    (measure/quality.py); an invalid row holds no figures and says why ("not measured: random
    weights", a path that gives no logits, a process that died)."""
    id: int | None = column("INTEGER PRIMARY KEY")  # None until stored
    model: str = column("TEXT NOT NULL")
    path: str = column("TEXT NOT NULL")  # a base path: +compile and +graphs change no arithmetic
    gpu: str = column("TEXT NOT NULL")
    text_sha256: str = column("TEXT NOT NULL")  # the evaluation text's (measure/texts.py)
    tokens: int = column("INTEGER NOT NULL")  # of the text, scored in windows of `window`
    window: int = column("INTEGER NOT NULL")
    status: str = column("TEXT NOT NULL")
    reason: str | None = column("TEXT", default=None)
    ppl: float | None = column("REAL", default=None)  # the path's perplexity, 95% interval
    ppl_low: float | None = column("REAL", default=None)
    ppl_high: float | None = column("REAL", default=None)
    reference_ppl: float | None = column("REAL", default=None)  # float32's on the same windows
    ppl_increase: float | None = column("REAL", default=None)  # ppl / reference_ppl - 1
    ppl_increase_low: float | None = column("REAL", default=None)
    ppl_increase_high: float | None = column("REAL", default=None)
    kl: float | None = column("REAL", default=None)  # mean KL(reference || path), nats/position
    kl_low: float | None = column("REAL", default=None)
    kl_high: float | None = column("REAL", default=None)
    prompts: int | None = column("INTEGER", default=None)  # greedy agreement over the prompts
    prompts_agreeing: int | None = column("INTEGER", default=None)
    mean_first_divergence: float | None = column("REAL", default=None)
    near_tie_divergences: int | None = column("INTEGER", default=None)
    # per prompt: first divergence, the reference's top-2 margin there, the two tokens
    greedy: list[dict] = column("TEXT NOT NULL", list, default_factory=list)
    fingerprint_key: str = column("TEXT NOT NULL")
    fingerprint: dict = column("TEXT NOT NULL", dict, default_factory=dict)
    # device, seed, formats, the text's token count, per-window figures, timings
    details: dict = column("TEXT NOT NULL", dict, default_factory=dict)
    finished_at: str = column("TEXT NOT NULL")
    run_id: int | None = column("INTEGER", default=None)

    @classmethod
    def of(cls, result: QualityResult, env: dict, env_key: str) -> QualityRow:
        k, s = result.key, result.summary or {}
        return cls(id=None, model=k.model, path=k.path, gpu=result.gpu, text_sha256=k.text,
                   tokens=k.tokens, window=k.window, status=result.status, reason=result.reason,
                   **{name: s.get(name) for name in QUALITY_FIGURES}, greedy=result.greedy,
                   fingerprint_key=env_key, fingerprint=env, details=result.details,
                   finished_at=now())


@dataclass(kw_only=True)
class SpeculationRow(StoredRow):
    """One row of the speculation table: speculative decoding on a workload of a model with
    trained weights (measure/speculation.py); an invalid row holds no figures and says why."""
    id: int | None = column("INTEGER PRIMARY KEY")  # None until stored
    model: str = column("TEXT NOT NULL")
    path: str = column("TEXT NOT NULL")  # one of the engine's base paths: its formats
    drafter: str = column("TEXT NOT NULL")  # "lookup" or the draft model as given
    workload: str = column("TEXT NOT NULL")
    texts_sha256: str = column("TEXT NOT NULL")  # the workload's prompts'
    draft_tokens: int | str = column("INTEGER NOT NULL")  # drafts a verify step, or "auto"
    max_new_tokens: int = column("INTEGER NOT NULL")
    dtype: str = column("TEXT NOT NULL")
    gpu: str = column("TEXT NOT NULL")
    status: str = column("TEXT NOT NULL")
    reason: str | None = column("TEXT", default=None)
    prompts: int | None = column("INTEGER", default=None)
    identical: int | None = column("INTEGER", default=None)  # replies equal to plain decoding's
    verify_steps: int | None = column("INTEGER", default=None)  # steps with a draft to check
    plain_steps: int | None = column("INTEGER", default=None)  # steps without one
    drafted: int | None = column("INTEGER", default=None)
    accepted: int | None = column("INTEGER", default=None)
    tokens: int | None = column("INTEGER", default=None)  # the decode's, each prefill's first out
    acceptance: float | None = column("REAL", default=None)  # accepted / drafted
    tokens_per_step: float | None = column("REAL", default=None)
    step_ms: float | None = column("REAL", default=None)  # the speculative decode's ms a step
    ms_per_token: float | None = column("REAL", default=None)  # ... and a token: effective
    plain_ms_per_token: float | None = column("REAL", default=None)  # without speculation
    speedup: float | None = column("REAL", default=None)  # plain_ms_per_token / ms_per_token
    mean_ctx: float | None = column("REAL", default=None)  # positions the steps read, mean
    floor_ms: float | None = column("REAL", default=None)  # of one step at mean_ctx
    floor_ms_per_token: float | None = column("REAL", default=None)  # floor / tokens a step
    fingerprint_key: str = column("TEXT NOT NULL")
    fingerprint: dict = column("TEXT NOT NULL", dict, default_factory=dict)
    # device, formats, per reply: prompt tokens, tokens, steps, identical, both decodes' ms
    details: dict = column("TEXT NOT NULL", dict, default_factory=dict)
    finished_at: str = column("TEXT NOT NULL")
    run_id: int | None = column("INTEGER", default=None)

    @property
    def key(self) -> SpeculationKey:
        return SpeculationKey(*(getattr(self, c) for c in SPECULATION_KEY))

    @classmethod
    def of(cls, result: SpeculationResult, env: dict, env_key: str) -> SpeculationRow:
        k, s = result.key, result.summary or {}
        return cls(id=None, model=k.model, path=k.path, drafter=k.drafter, workload=k.workload,
                   texts_sha256=k.texts, draft_tokens=k.draft_tokens,
                   max_new_tokens=k.max_new_tokens, dtype=k.dtype, gpu=result.gpu,
                   status=result.status, reason=result.reason,
                   **{name: s.get(name) for name in SPECULATION_FIGURES},
                   fingerprint_key=env_key, fingerprint=env, details=result.details,
                   finished_at=now())


CELL_FIELDS = fields(CellRow)
COLUMNS = tuple(c.name for c in CELL_FIELDS)
QUALITY_FIELDS = fields(QualityRow)
QUALITY_COLUMNS = tuple(c.name for c in QUALITY_FIELDS)
SPECULATION_FIELDS = fields(SpeculationRow)


def numbers(row_fields) -> tuple[str, ...]:
    """A table's numeric columns (SQLite would store any value in them)."""
    return tuple(c.name for c in row_fields[1:]
                 if c.metadata["sql"].startswith(("INTEGER", "REAL")))


def json_columns(row_fields) -> dict:
    """A table's JSON columns, with the kind each holds."""
    return {c.name: c.metadata["json"] for c in row_fields if c.metadata["json"]}


OTHER_TABLES = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    command TEXT NOT NULL,         -- sweep, quality, speculate, ab, explain, probe (merge:
                                   -- older rows)
    label TEXT,                    -- a name the user gave the run (--label)
    argv TEXT NOT NULL,            -- JSON list: the command line as typed
    options TEXT NOT NULL,         -- JSON: every option as resolved
    provenance TEXT NOT NULL,      -- JSON: the environment (measure/fingerprint.py)
    fingerprint_key TEXT NOT NULL,
    started_at TEXT NOT NULL, finished_at TEXT  -- NULL: the run did not end (killed)
);
CREATE INDEX IF NOT EXISTS cells_by_key ON cells (model, ctx, path, steps, warmup, fingerprint_key);
CREATE TABLE IF NOT EXISTS ab_experiments (
    id INTEGER PRIMARY KEY,
    a TEXT NOT NULL, b TEXT NOT NULL, model TEXT NOT NULL, ctx INTEGER NOT NULL,
    gpu TEXT NOT NULL, paired INTEGER NOT NULL,
    plan TEXT NOT NULL,            -- JSON: sessions, steps, block, warmup, seed ...
    summary TEXT,                  -- JSON, once every session has ended
    fingerprint_key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    started_at TEXT NOT NULL, finished_at TEXT, run_id INTEGER
);
CREATE TABLE IF NOT EXISTS ab_sessions (
    experiment_id INTEGER NOT NULL REFERENCES ab_experiments(id),
    idx INTEGER NOT NULL, status TEXT NOT NULL, reason TEXT, first_arm TEXT,
    ms_a REAL, ms_b REAL, ratio REAL,
    samples_a TEXT NOT NULL, samples_b TEXT NOT NULL,  -- JSON lists
    finished_at TEXT NOT NULL,
    details TEXT                   -- JSON: warm-up steps and energy per arm (NULL before schema 6)
);
CREATE TABLE IF NOT EXISTS explanations (
    id INTEGER PRIMARY KEY,
    model TEXT NOT NULL, ctx INTEGER NOT NULL, path TEXT NOT NULL, gpu TEXT NOT NULL,
    fingerprint_key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    results TEXT NOT NULL,         -- JSON: decomposition and per-class times
    finished_at TEXT NOT NULL, run_id INTEGER
);
CREATE INDEX IF NOT EXISTS quality_by_key ON quality (model, path, gpu, text_sha256, tokens,
                                                   window, fingerprint_key);
CREATE TABLE IF NOT EXISTS probes (
    id INTEGER PRIMARY KEY,
    device TEXT NOT NULL, fingerprint_key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    results TEXT NOT NULL,         -- JSON: each figure with its unit and method
    finished_at TEXT NOT NULL, run_id INTEGER
);
"""



def create_table(name: str, row_fields) -> str:
    return (f"CREATE TABLE IF NOT EXISTS {name} (\n"
            + ",\n".join(f"    {c.name} {c.metadata['sql']}" for c in row_fields) + "\n);")


SCHEMA = "\n".join((create_table("cells", CELL_FIELDS), create_table("quality", QUALITY_FIELDS),
                    create_table("speculation", SPECULATION_FIELDS), OTHER_TABLES))


def _is_auto(value) -> bool:
    return isinstance(value, str) and (value == "auto" or value.startswith("auto:"))


def check_numbers(row: dict, columns, where: str) -> None:
    """One line naming the row where one of its numeric `columns` holds something else (steps,
    warmup and draft_tokens may hold the automatic rule)."""
    for k in columns:
        value = row.get(k)
        if (value is not None and not isinstance(value, (int, float))
                and not (k in ("steps", "warmup", "draft_tokens") and _is_auto(value))):
            raise FloorlineError(f"{where}: {k} is not a number but {value!r} (a damaged row)")


def cell_problem(row: dict) -> str | None:
    """The figures of a cells row that no measured cell has, or None: a median that is not a
    positive number (every figure read from it divides by it), and for a valid cell a floor or
    byte count that is not."""
    figures = (("median_ms", "floor_ms", "weight_bytes", "kv_bytes", "total_bytes")
               if row.get("status") == VALID else ("median_ms",))
    bad = [f"{k} {row[k]!r}" for k in figures
           if row.get(k) is not None and not 0 < row[k] < math.inf]
    return ", ".join(bad) or None


def check_cell(row: dict, where: str) -> None:
    """One line naming a cells row whose figures no measured cell has (cell_problem)."""
    problem = cell_problem(row)
    if problem:
        raise FloorlineError(f"{where}: {row['status']} with {problem}, which no measured cell "
                             "has (a damaged row)")


# The figures every valid speculation row has, each a positive number (the report divides by
# and draws them).
SPECULATION_NEEDED = ("tokens", "tokens_per_step", "step_ms", "ms_per_token",
                      "plain_ms_per_token", "floor_ms", "floor_ms_per_token")


def check_speculation(row: dict, where: str) -> None:
    """One line naming a valid speculation row without one of its figures (a damaged row)."""
    if row.get("status") != VALID:
        return
    bad = [f"{k} {row.get(k)!r}" for k in SPECULATION_NEEDED
           if not isinstance(row.get(k), (int, float)) or not 0 < row[k] < math.inf]
    if bad:
        raise FloorlineError(f"{where}: valid with {', '.join(bad)}, which no measurement has "
                             "(a damaged row)")


def parse_json(text, where: str, column: str, kind=dict):
    """A JSON column's value; one line naming the row where it is not valid JSON of `kind`."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, kind):
        raise FloorlineError(f"{where}: {column} is not a JSON "
                             f"{'object' if kind is dict else 'list'} (a damaged row)")
    return value


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Store:
    def __init__(self, path: str | Path, read_only: bool = False):
        """The database at `path`, made if absent; `read_only` opens an existing one without
        writing anything (its schema included), so a read-only file or a shared copy can be
        shown and reported on."""
        self.path = Path(path)
        self.damaged: list[str] = []  # rows that rows(skip_damaged=True) left out, and why
        self.made = False  # whether this Store made the file (merge removes one left empty)
        if read_only:
            self._db = _open_existing(self.path)
            return
        self._db = self._create()
        self.run_id: int | None = None  # the run that rows added now belong to (begin_run)

    def _create(self) -> sqlite3.Connection:
        """The database at `path`, made if absent, its schema brought up to this version."""
        self.made = not self.path.exists()
        try:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            db.execute("PRAGMA busy_timeout = 60000")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise FloorlineError(f"{self.path} was written by a newer floorline "
                                     f"(schema {version}, this one reads {SCHEMA_VERSION})")
            db.execute("PRAGMA journal_mode = WAL")
            # The schema in one transaction that takes the write lock first: statements that
            # read the schema and then write, beside another process doing the same, can get
            # "database is locked" at once, without waiting out the busy timeout.
            db.executescript("BEGIN IMMEDIATE;\n" + SCHEMA)
            for table in RUN_TABLES:  # a database from before schema 4
                if "run_id" not in table_columns(db, table):
                    db.execute(f"ALTER TABLE {table} ADD COLUMN run_id INTEGER")
            if "details" not in table_columns(db, "ab_sessions"):  # from before schema 6
                db.execute("ALTER TABLE ab_sessions ADD COLUMN details TEXT")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            raise FloorlineError(f"cannot use results database {self.path}: {e}") from None
        return db

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:  # removed (remove), and used again
            self._db = self._create()
        return self._db

    def remove(self) -> None:
        """Closes and deletes the file (a failed merge's new target)."""
        self.close()
        self._db = None
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    def close(self) -> None:
        self.db.close()

    def begin_run(self, command: str, options: dict, env: dict, env_key: str,
                  label: str | None = None) -> int:
        """Start a run: every row added from now on points at it. `options` holds every option
        as resolved; the command line is this process's."""
        self.run_id = self._insert("runs", {
            "command": command, "label": label,
            "argv": json.dumps(["floorline", *sys.argv[1:]]),
            "options": json.dumps(options, sort_keys=True, default=str),
            "provenance": json.dumps(env, sort_keys=True), "fingerprint_key": env_key,
            "started_at": now()})
        return self.run_id

    def end_run(self) -> None:
        """The run ended (a run killed before this keeps finished_at empty)."""
        if self.run_id is not None:
            self.db.execute("UPDATE runs SET finished_at=? WHERE id=?", (now(), self.run_id))

    def runs(self) -> list[dict]:
        """Every run, oldest first, its JSON columns decoded and its rows counted per table."""
        names = ["id", "command", "label", "argv", "options", "provenance", "fingerprint_key",
                 "started_at", "finished_at"]
        tables = [t for t in RUN_TABLES if "run_id" in table_columns(self.db, t)]
        out = []
        for values in self._read(f"SELECT {', '.join(names)} FROM runs ORDER BY id"):
            run = dict(zip(names, values))
            for k, kind in (("argv", list), ("options", dict), ("provenance", dict)):
                run[k] = self._json(run[k], "runs", run["id"], k, kind)
            run["rows"] = {t: self._read(f"SELECT count(*) FROM {t} WHERE run_id=?",
                                         (run["id"],))[0][0]
                           for t in tables}
            out.append(run)
        return out

    def add(self, cell: CellResult, env: dict, env_key: str) -> int:
        row = CellRow.of(cell, env, env_key).stored()
        problem = cell_problem(row)
        if problem:
            raise ValueError(f"a cell with {problem} is never {cell.status}")
        return self._insert("cells", row)

    def add_quality(self, result: QualityResult, env: dict, env_key: str) -> int:
        return self._insert("quality", QualityRow.of(result, env, env_key).stored())

    def add_speculation(self, result: SpeculationResult, env: dict, env_key: str) -> int:
        return self._insert("speculation", SpeculationRow.of(result, env, env_key).stored())

    def _insert(self, table: str, row: dict) -> int:
        if table in RUN_TABLES and row.get("run_id") is None:
            row = {**row, "run_id": self.run_id}
        names = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        return self._write(f"INSERT INTO {table} ({names}) VALUES ({marks})", row).lastrowid

    def _write(self, sql: str, params=()) -> sqlite3.Cursor:
        """A statement that writes; one line naming the file where it fails."""
        try:
            return self.db.execute(sql, params)
        except (sqlite3.DatabaseError, OverflowError) as e:
            raise FloorlineError(f"cannot write to results database {self.path}: {e}") from None

    def start_ab(self, plan: dict, env: dict, env_key: str) -> int:
        return self._insert("ab_experiments", {
            **{k: plan[k] for k in ("a", "b", "model", "ctx", "gpu")},
            "paired": int(plan["paired"]),
            "plan": json.dumps(plan, sort_keys=True), "fingerprint_key": env_key,
            "fingerprint": json.dumps(env, sort_keys=True), "started_at": now()})

    def add_ab_session(self, experiment_id: int, session) -> None:
        self._insert("ab_sessions", {
            "experiment_id": experiment_id, "idx": session.index, "status": session.status,
            "reason": session.reason, "first_arm": session.first_arm, "ms_a": session.ms_a,
            "ms_b": session.ms_b, "ratio": session.ratio,
            "samples_a": json.dumps(session.samples_a), "samples_b": json.dumps(session.samples_b),
            "finished_at": now(),
            "details": json.dumps({k: getattr(session, k) for k in SESSION_DETAILS},
                                  sort_keys=True)})

    def unfinished_abs(self, env_key: str | None = None) -> list[dict]:
        """Every A/B experiment without a summary (cut off), newest first, of the environment
        `env_key` where one is given: its id, stored plan and sessions (each row's columns, its
        JSON decoded, in session order)."""
        where, params = ("AND fingerprint_key=?", (env_key,)) if env_key is not None else ("", ())
        found = []
        for i, text in self._read(f"SELECT id, plan FROM ab_experiments WHERE summary IS NULL "
                                  f"{where} ORDER BY id DESC", params):
            names = ["idx", "status", "reason", "first_arm", "samples_a", "samples_b", "details"]
            sessions = []
            for values in self._read(f"SELECT {', '.join(names)} FROM ab_sessions WHERE "
                                     "experiment_id=? ORDER BY idx", (i,)):
                row = dict(zip(names, values))
                for k, kind in (("samples_a", list), ("samples_b", list), ("details", dict)):
                    row[k] = (None if row[k] is None
                              else self._json(row[k], "ab_sessions", i, k, kind))
                sessions.append(row)
            found.append({"id": i, "plan": self._json(text, "ab_experiments", i, "plan"),
                          "sessions": sessions})
        return found

    def unfinished_ab(self, plan: dict, env_key: str, any_seed: bool) -> dict | None:
        """The newest cut-off A/B (unfinished_abs) whose plan is `plan`'s (its seed aside where
        `any_seed`; its per-session time limit aside always) in the environment `env_key`;
        None where there is none."""
        ignored = {"timeout_s"} | ({"seed"} if any_seed else set())
        same = lambda p: {k: v for k, v in p.items() if k not in ignored}  # noqa: E731
        return next((e for e in self.unfinished_abs(env_key) if same(e["plan"]) == same(plan)),
                    None)

    def finish_ab(self, experiment_id: int, summary: dict) -> None:
        self.db.execute("UPDATE ab_experiments SET summary=?, finished_at=? WHERE id=?",
                        (json.dumps(summary, sort_keys=True), now(), experiment_id))

    def _read(self, sql: str, params=()) -> list[tuple]:
        """Every row a query returns; one line for a damaged file."""
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as e:
            raise FloorlineError(f"cannot read results database {self.path}: {e}") from None

    def _json(self, text, table: str, row_id, column: str, kind=dict):
        return parse_json(text, f"{self.path}: {table} row {row_id}", column, kind)

    def ab_summaries(self) -> list[dict]:
        """Every finished A/B experiment's summary, with its id."""
        rows = self._read(
            "SELECT id, summary FROM ab_experiments WHERE summary IS NOT NULL ORDER BY id")
        return [{"id": i, **self._json(v, "ab_experiments", i, "summary")} for i, v in rows]

    def explanations(self) -> list[dict]:
        rows = self._read("SELECT id, results FROM explanations ORDER BY id")
        return [{"id": i, **self._json(v, "explanations", i, "results")} for i, v in rows]

    def add_probe(self, device: str, results: dict, env: dict, env_key: str) -> int:
        return self._insert("probes", {
            "device": device, "fingerprint_key": env_key,
            "fingerprint": json.dumps(env, sort_keys=True),
            "results": json.dumps(results, sort_keys=True), "finished_at": now()})

    def add_explanation(self, results: dict, env: dict, env_key: str) -> int:
        return self._insert("explanations", {
            **{k: results[k] for k in ("model", "ctx", "path", "gpu")},
            "fingerprint_key": env_key, "fingerprint": json.dumps(env, sort_keys=True),
            "results": json.dumps(results, sort_keys=True), "finished_at": now()})

    def probes(self) -> dict[str, dict]:
        """The newest probe of each environment, by fingerprint key, with `host_layers`: the
        host's layer times of all of that environment's probes (each probe times one model's
        architecture; host_layers()), the newest of each path and architecture."""
        newest, every = {}, {}
        for i, key, results in self._read(
                "SELECT id, fingerprint_key, results FROM probes ORDER BY id"):
            newest[key] = self._json(results, "probes", i, "results")
            every.setdefault(key, []).append(newest[key])
        return {key: {**r, "host_layers": host_layers(every[key])} for key, r in newest.items()}

    def probe_devices(self) -> dict[str, str]:
        """The device each probed environment recorded (a GPU's name), by fingerprint key."""
        rows = self._read("SELECT id, fingerprint_key, fingerprint FROM probes")
        return {key: str(self._json(env, "probes", i, "fingerprint").get("device", ""))
                for i, key, env in rows}

    def has_valid(self, key: CellKey, env_key: str) -> bool:
        return bool(self._read(
            "SELECT 1 FROM cells WHERE model=? AND ctx=? AND path=? AND steps=? AND warmup=? "
            "AND fingerprint_key=? AND status=? LIMIT 1",
            (key.model, key.ctx, key.path, key.steps, key.warmup, env_key, VALID)))

    def has_valid_quality(self, key: QualityKey, gpu: str, env_key: str) -> bool:
        return bool(self._read(
            "SELECT 1 FROM quality WHERE model=? AND path=? AND gpu=? AND text_sha256=? AND "
            "tokens=? AND window=? AND fingerprint_key=? AND status=? LIMIT 1",
            (key.model, key.path, gpu, key.text, key.tokens, key.window, env_key, VALID)))

    def has_valid_speculation(self, key: SpeculationKey, gpu: str, env_key: str) -> bool:
        return bool(self._read(
            f"SELECT 1 FROM speculation WHERE {' AND '.join(f'{c}=?' for c in SPECULATION_KEY)} "
            "AND gpu=? AND fingerprint_key=? AND status=? LIMIT 1",
            (*astuple(key), gpu, env_key, VALID)))

    def cell_count(self) -> int:
        return self._read("SELECT count(*) FROM cells")[0][0]

    def rows(self, latest: bool = True, skip_damaged: bool = False) -> list[CellRow]:
        """Every stored cell, or only the newest row of each cell (model, ctx, path, steps,
        warmup, environment). A row whose JSON columns are damaged is one line, or with
        `skip_damaged` left out and named in `self.damaged`."""
        return self._rows(CellRow, "cells", "model, ctx, path, steps, warmup, fingerprint_key",
                          latest, skip_damaged)

    def quality_rows(self, latest: bool = True, skip_damaged: bool = False) -> list[QualityRow]:
        """Every stored quality measurement, or only the newest of each (model, path, gpu, text,
        tokens, window, environment); damaged rows as rows() treats them."""
        return self._rows(QualityRow, "quality",
                          "model, path, gpu, text_sha256, tokens, window, fingerprint_key",
                          latest, skip_damaged)

    def speculation_rows(self, latest: bool = True,
                         skip_damaged: bool = False) -> list[SpeculationRow]:
        """Every stored speculation measurement, or only the newest of each (key, gpu,
        environment); damaged rows as rows() treats them."""
        return self._rows(SpeculationRow, "speculation",
                          ", ".join((*SPECULATION_KEY, "gpu", "fingerprint_key")), latest,
                          skip_damaged)

    def _rows(self, row_class, table: str, key: str, latest: bool, skip_damaged: bool) -> list:
        row_fields = fields(row_class)
        held = table_columns(self.db, table)  # a read-only database from before schema 4
        names = [c.name for c in row_fields if c.name in held]
        where = (f"WHERE id IN (SELECT MAX(id) FROM {table} GROUP BY {key})" if latest else "")
        out = []
        for values in self._read(f"SELECT {', '.join(names)} FROM {table} {where} ORDER BY id"):
            row = dict(zip(names, values))
            try:
                check_numbers(row, numbers(row_fields), f"{self.path}: {table} row {row['id']}")
                for k, kind in json_columns(row_fields).items():
                    row[k] = self._json(row[k], table, row["id"], k, kind)
            except FloorlineError as e:
                if not skip_damaged:
                    raise
                self.damaged.append(str(e).removeprefix(f"{self.path}: "))
                continue
            out.append(row_class(**row))
        return out


# The speculation table's columns that hold its key: records.SpeculationKey's fields, in order.
SPECULATION_KEY = ("model", "path", "drafter", "workload", "texts_sha256", "draft_tokens",
                   "max_new_tokens", "dtype")


def table_columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in db.execute(f"PRAGMA table_info({table})")]


def base_path(path: str) -> str:
    """A cell's path without its options (+compile, +graphs), which change no arithmetic."""
    return path.split("+")[0]


def quality_by_cell(cells: list[CellRow], quality: list[QualityRow]) -> dict[int, QualityRow]:
    """Each cell's quality, by cell id: the newest row of its model, base path and gpu, a valid
    one where there is one; where its base path has none, that of the path whose quality it
    shares (records.SAME_QUALITY)."""
    best: dict[tuple, QualityRow] = {}
    for q in quality:  # in order of id: a later row replaces an earlier one, unless invalid
        k = (q.model, q.path, q.gpu)
        if k not in best or q.status == VALID or best[k].status != VALID:
            best[k] = q
    matched = {}
    for c in cells:
        base = base_path(c.path)
        for path in (base, SAME_QUALITY.get(base)):
            if (k := (c.model, path, c.gpu)) in best:
                matched[c.id] = best[k]
                break
    return matched


# What makes two rows the same result, per table (every column but the row id and its run's
# id, which differ between databases, and for cells the details, where a merge records where
# the row came from). The runs table comes first: a merge maps each run before its rows.
IDENTITY = {
    "runs": ["command", "label", "argv", "options", "fingerprint_key", "started_at"],
    "cells": [c for c in COLUMNS if c not in ("id", "details", "run_id")],
    "ab_experiments": ["a", "b", "model", "ctx", "gpu", "paired", "plan", "fingerprint_key",
                       "started_at"],
    "explanations": ["model", "ctx", "path", "gpu", "fingerprint_key", "results", "finished_at"],
    "probes": ["device", "fingerprint_key", "results", "finished_at"],
    "quality": [c for c in QUALITY_COLUMNS if c not in ("id", "run_id")],
    "speculation": [c.name for c in SPECULATION_FIELDS if c.name not in ("id", "run_id")],
}


# The columns a merge checks before copying a row: JSON ones, with the kind each holds, and
# numeric ones (SQLite would store any value in them).
JSON_COLUMNS = {
    "runs": {"argv": list, "options": dict, "provenance": dict},
    "cells": json_columns(CELL_FIELDS),
    "ab_experiments": {"plan": dict, "fingerprint": dict},
    "explanations": {"results": dict, "fingerprint": dict},
    "probes": {"results": dict, "fingerprint": dict},
    "quality": json_columns(QUALITY_FIELDS),
    "speculation": json_columns(SPECULATION_FIELDS),
}
NUMBER_COLUMNS = {
    "runs": (),
    "cells": numbers(CELL_FIELDS),
    "ab_experiments": ("ctx", "paired", "run_id"),
    "explanations": ("ctx", "run_id"),
    "probes": ("run_id",),
    "quality": numbers(QUALITY_FIELDS),
    "speculation": numbers(SPECULATION_FIELDS),
}


def _open_existing(path: Path) -> sqlite3.Connection:
    """A results database, read-only; one line if it is missing or not a floorline database."""
    if not path.is_file():
        raise FloorlineError(f"no results database at {path}: run `floorline sweep` first")
    def connect(extra=""):
        db = sqlite3.connect(f"file:{path}?mode=ro{extra}", uri=True, timeout=60)
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        return db, version, tables

    try:
        try:
            db, version, tables = connect()
        except sqlite3.OperationalError:
            # A WAL database in a folder this user cannot write: SQLite cannot make the shared
            # memory file it reads through, so read it as a file nobody is writing.
            db, version, tables = connect("&immutable=1")
    except sqlite3.DatabaseError as e:
        raise FloorlineError(f"cannot use results database {path}: {e}") from None
    if version > SCHEMA_VERSION:
        raise FloorlineError(f"{path} was written by a newer floorline (schema {version}, this "
                             f"one reads {SCHEMA_VERSION})")
    if "cells" not in tables:
        raise FloorlineError(f"{path} is not a floorline results database (no cells table)")
    # A database from before schema 2 has cells only: the later tables read as empty, made in
    # the connection's temporary schema so that nothing is written to the file.
    for statement in SCHEMA.split(";"):
        made = re.match(r"\s*CREATE TABLE IF NOT EXISTS (\w+)", statement)
        if made and made.group(1) not in tables:
            db.execute(statement.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
    return db


def merge(target: Store, sources: list[Path]) -> dict[str, dict[str, int]]:
    """Copies every row of `sources` into `target` that it does not already hold (by IDENTITY):
    runs, then the rows pointing at them (cells with `merged_from`, the file name and row id,
    added to their details; A/B experiments with their sessions). Rows measured before runs
    were recorded get a run of command "merge" per source and environment, its provenance that
    environment, its times those of its first and last row. Every row is checked as a measured
    one is before it is written. All or nothing: one transaction over every source, so that a
    source that fails leaves the target as it was (a new target left empty is removed).
    Returns {source: {table: rows copied}}; duplicates are skipped."""
    try:
        target._write("BEGIN IMMEDIATE")
        report = {str(source): _merge_source(target, Path(source)) for source in sources}
        target._write("COMMIT")
    except BaseException as e:
        _undo(target)
        if isinstance(e, FloorlineError):
            raise FloorlineError(f"{e}; nothing was merged") from None
        raise
    return report


def _undo(target: Store) -> None:
    """The target as it was: the merge rolled back, and a file its Store made removed where it
    holds no row."""
    if target.db.in_transaction:
        target.db.execute("ROLLBACK")
    if target.made and not any(target._read(f"SELECT 1 FROM {table} LIMIT 1")
                               for table in IDENTITY):
        target.remove()


def _merge_source(target: Store, source: Path) -> dict[str, int]:
    """Copies one source's new rows, inside the merge's transaction: {table: rows copied}."""
    src = _open_existing(source)
    try:
        runs = _Runs(target, source.name)
        return {table: _merge_table(target, src, source, table, runs) for table in IDENTITY}
    except sqlite3.DatabaseError as e:  # reading the source: the target's own name the target
        raise FloorlineError(f"cannot read results database {source}: {e}") from None
    finally:
        src.close()


def _merge_table(target: Store, src, source: Path, table: str, runs: _Runs) -> int:
    identity = IDENTITY[table]
    held = (f"SELECT id FROM {table} WHERE " + " AND ".join(f"{c} IS :{c}" for c in identity)
            + " LIMIT 1")
    names = _columns(target, src, source, table)
    copied = 0
    for values in src.execute(f"SELECT {', '.join(names)} FROM {table} ORDER BY id"):
        row = dict(zip(names, values))
        old_id = row.pop("id")
        where = f"{source}: {table} row {old_id}"
        check_numbers(row, NUMBER_COLUMNS[table], where)
        parsed = {column: parse_json(row.get(column), where, column, kind)
                  for column, kind in JSON_COLUMNS[table].items()}
        if table == "cells":
            check_cell(row, where)
        if table == "speculation":
            check_speculation(row, where)
        found = target._read(held, {c: row.get(c) for c in identity})
        if found:
            if table == "runs":
                runs.mapped[old_id] = found[0][0]
            continue
        if table == "cells":
            details = parsed["details"]
            details.setdefault("merged_from", {"file": source.name, "id": old_id})
            row["details"] = json.dumps(details, sort_keys=True)
        if table != "runs":
            row["run_id"] = runs.of(row, parsed)
        new_id = target._insert(table, row)
        copied += 1
        if table == "runs":
            runs.mapped[old_id] = new_id
        if table == "ab_experiments":
            _copy_sessions(src, source, target, old_id, new_id)
    return copied


def _columns(target: Store, src, source: Path, table: str) -> list[str]:
    """The source's columns of `table`; one line where the target lacks one (its values would
    be lost). A column only the target has takes its default."""
    names = table_columns(src, table)
    extra = [n for n in names if n not in table_columns(target.db, table)]
    if extra:
        raise FloorlineError(f"{source}: {table} has column(s) {', '.join(extra)} that "
                             f"{target.path} lacks, so merging would drop their values")
    return names


class _Runs:
    """A merge's runs: the source's run ids mapped to the target's, and the runs it makes for
    rows from before runs were recorded."""

    def __init__(self, target: Store, source: str):
        self.target, self.source = target, source
        self.mapped: dict[int, int] = {}
        self.made: dict[str, int] = {}  # by fingerprint key

    def of(self, row: dict, parsed: dict) -> int:
        if row.get("run_id") is not None and row["run_id"] in self.mapped:
            return self.mapped[row["run_id"]]
        key = row["fingerprint_key"]
        when = row.get("started_at") or row["finished_at"]
        if key not in self.made:
            self.made[key] = self.target._insert("runs", {
                "command": "merge", "label": None, "argv": json.dumps([]),
                "options": json.dumps({"merged_from": self.source, "note": (
                    "rows measured before floorline recorded runs: their provenance is the "
                    "environment each row recorded")}, sort_keys=True),
                "provenance": json.dumps(parsed["fingerprint"], sort_keys=True),
                "fingerprint_key": key, "started_at": when, "finished_at": when})
        else:
            self.target._write(
                "UPDATE runs SET started_at=MIN(started_at, :t), finished_at=MAX(finished_at, :t) "
                "WHERE id=:id", {"t": when, "id": self.made[key]})
        return self.made[key]


def _copy_sessions(src, source: Path, target: Store, old_id: int, new_id: int) -> None:
    names = _columns(target, src, source, "ab_sessions")
    for values in src.execute(f"SELECT {', '.join(names)} FROM ab_sessions WHERE experiment_id=? "
                              "ORDER BY idx", (old_id,)):
        target._insert("ab_sessions", {**dict(zip(names, values)), "experiment_id": new_id})
