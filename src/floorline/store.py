"""The results database: one SQLite row per measured cell, committed as each cell ends.

WAL journalling and a long busy timeout let several sweeps write one file at once; a cell is
one INSERT in its own transaction, so a run killed at any point keeps every finished cell.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

from floorline.errors import FloorlineError
from floorline.measure.cell import VALID, CellKey, CellResult

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS cells (
    id INTEGER PRIMARY KEY,
    model TEXT NOT NULL, ctx INTEGER NOT NULL, path TEXT NOT NULL,
    steps INTEGER NOT NULL, warmup INTEGER NOT NULL, gpu TEXT NOT NULL,
    status TEXT NOT NULL, reason TEXT,
    median_ms REAL, p10_ms REAL, p90_ms REAL, mean_ms REAL,
    floor_ms REAL, floor_ms_all_params REAL, fraction_of_floor REAL, achieved_gbps REAL,
    weight_bytes INTEGER, kv_bytes INTEGER, total_bytes INTEGER, peak_gbps REAL,
    weight_format TEXT, kv_dtype TEXT,
    samples_ms TEXT NOT NULL,      -- JSON list, every timed step
    fingerprint_key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,     -- JSON: versions, device, driver, clocks
    details TEXT NOT NULL,         -- JSON: seed, device, peak source, compile mode ...
    finished_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS cells_by_key ON cells (model, ctx, path, steps, warmup, fingerprint_key);
"""

COLUMNS = ("id", "model", "ctx", "path", "steps", "warmup", "gpu", "status", "reason",
           "median_ms", "p10_ms", "p90_ms", "mean_ms", "floor_ms", "floor_ms_all_params",
           "fraction_of_floor", "achieved_gbps", "weight_bytes", "kv_bytes", "total_bytes",
           "peak_gbps", "weight_format", "kv_dtype", "samples_ms", "fingerprint_key",
           "fingerprint", "details", "finished_at")


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            self.db.execute("PRAGMA busy_timeout = 60000")
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise FloorlineError(f"{self.path} was written by a newer floorline "
                                     f"(schema {version}, this one reads {SCHEMA_VERSION})")
            self.db.execute("PRAGMA journal_mode = WAL")
            self.db.executescript(SCHEMA)
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as e:
            raise FloorlineError(f"cannot use results database {self.path}: {e}") from None

    def close(self) -> None:
        self.db.close()

    def add(self, cell: CellResult, env: dict, env_key: str) -> int:
        s, f = cell.summary or {}, cell.floor or {}
        row = {
            **{k: getattr(cell.key, k) for k in ("model", "ctx", "path", "steps", "warmup")},
            "gpu": cell.gpu, "status": cell.status, "reason": cell.reason,
            **{k: s.get(k) for k in ("median_ms", "p10_ms", "p90_ms", "mean_ms")},
            **{k: f.get(k) for k in ("floor_ms", "floor_ms_all_params", "weight_bytes",
                                     "kv_bytes", "total_bytes", "peak_gbps", "weight_format",
                                     "kv_dtype")},
            "fraction_of_floor": cell.fraction_of_floor, "achieved_gbps": cell.achieved_gbps,
            "samples_ms": json.dumps(cell.samples_ms), "fingerprint_key": env_key,
            "fingerprint": json.dumps(env, sort_keys=True),
            "details": json.dumps(cell.details, sort_keys=True),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        names = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        try:
            return self.db.execute(f"INSERT INTO cells ({names}) VALUES ({marks})", row).lastrowid
        except sqlite3.DatabaseError as e:
            raise FloorlineError(f"cannot write to results database {self.path}: {e}") from None

    def has_valid(self, key: CellKey, env_key: str) -> bool:
        return self.db.execute(
            "SELECT 1 FROM cells WHERE model=? AND ctx=? AND path=? AND steps=? AND warmup=? "
            "AND fingerprint_key=? AND status=? LIMIT 1",
            (key.model, key.ctx, key.path, key.steps, key.warmup, env_key, VALID),
        ).fetchone() is not None

    def rows(self, latest: bool = True) -> list[dict]:
        """Every stored cell, or only the newest row of each cell (model, ctx, path, steps,
        warmup, environment)."""
        where = ("WHERE id IN (SELECT MAX(id) FROM cells GROUP BY model, ctx, path, steps, "
                 "warmup, fingerprint_key)") if latest else ""
        cursor = self.db.execute(f"SELECT {', '.join(COLUMNS)} FROM cells {where} ORDER BY id")
        out = []
        for values in cursor:
            row = dict(zip(COLUMNS, values))
            for k in ("samples_ms", "fingerprint", "details"):
                row[k] = json.loads(row[k])
            out.append(row)
        return out
