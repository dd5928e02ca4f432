import sqlite3

import pytest

from floorline.errors import FloorlineError
from floorline.measure.cell import INVALID, VALID, CellKey, CellResult
from floorline.store import SCHEMA_VERSION, Store


def cell(ctx, status=VALID):
    summary = {"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 3.0, "mean_ms": 2.0, "n": 3}
    return CellResult(CellKey("m", ctx, "hf-eager", 3, 1), "l4", status,
                      None if status == VALID else "out of memory: x", [1.0, 2.0, 3.0],
                      summary if status == VALID else None,
                      {"floor_ms": 1.0, "total_bytes": 300_000_000}, {"seed": 0})


def test_rows_round_trip_and_validity_is_per_environment(tmp_path):
    store = Store(tmp_path / "r.db")
    store.add(cell(8), {"torch": "x"}, "env-a")
    store.add(cell(16, INVALID), {"torch": "x"}, "env-a")
    assert store.has_valid(CellKey("m", 8, "hf-eager", 3, 1), "env-a")
    assert not store.has_valid(CellKey("m", 8, "hf-eager", 3, 1), "env-b")
    assert not store.has_valid(CellKey("m", 16, "hf-eager", 3, 1), "env-a")
    rows = {r["ctx"]: r for r in store.rows()}
    assert rows[8]["samples_ms"] == [1.0, 2.0, 3.0] and rows[8]["fingerprint"] == {"torch": "x"}
    assert rows[8]["fraction_of_floor"] == 0.5 and rows[8]["achieved_gbps"] == 150.0
    assert rows[16]["reason"] == "out of memory: x" and rows[16]["median_ms"] is None
    store.add(cell(8), {"torch": "x"}, "env-a")
    assert len(store.rows()) == 2 and len(store.rows(latest=False)) == 3


def test_a_database_from_a_newer_floorline_is_refused(tmp_path):
    path = tmp_path / "r.db"
    Store(path).close()
    sqlite3.connect(path).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(FloorlineError, match="newer floorline"):
        Store(path)
