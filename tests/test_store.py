import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from floorline.errors import FloorlineError
from floorline.records import INVALID, VALID, CellKey, CellResult
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
    rows = {r.ctx: r for r in store.rows()}
    assert rows[8].samples_ms == [1.0, 2.0, 3.0] and rows[8].fingerprint == {"torch": "x"}
    assert rows[8].fraction_of_floor == 0.5 and rows[8].achieved_gbps == 150.0
    assert rows[16].reason == "out of memory: x" and rows[16].median_ms is None
    store.add(cell(8), {"torch": "x"}, "env-a")
    assert len(store.rows()) == 2 and len(store.rows(latest=False)) == 3


def test_a_database_from_a_newer_floorline_is_refused(tmp_path):
    path = tmp_path / "r.db"
    Store(path).close()
    sqlite3.connect(path).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(FloorlineError, match="newer floorline"):
        Store(path)


class Session:  # what Store.add_ab_session reads of an A/B session
    def __init__(self, index):
        self.index, self.status, self.reason, self.first_arm = index, VALID, None, "a"
        self.ms_a, self.ms_b, self.ratio = 2.0, 1.0, 2.0
        self.samples_a, self.samples_b = [2.0], [1.0]
        self.warmup_steps, self.energy_a, self.energy_b, self.energy_note = [8, 8], None, None, None


def test_merge_copies_each_result_once_and_keeps_where_it_came_from(tmp_path, cli):
    import json

    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    first = Store(a)
    first.add(cell(8), {"torch": "x"}, "env-a")
    first.add(cell(16, INVALID), {"torch": "x"}, "env-a")
    experiment = first.start_ab({"a": "p", "b": "q", "model": "m", "ctx": 8, "gpu": "l4",
                                 "paired": True}, {"torch": "x"}, "env-a")
    for i in range(3):
        first.add_ab_session(experiment, Session(i))
    first.finish_ab(experiment, {"speedup": 2.0})
    first.add_probe("cpu", {"read_gbps": 10.0}, {"torch": "x"}, "env-a")
    second = Store(b)
    second.add(cell(8), {"torch": "y"}, "env-b")
    first.close(), second.close()

    proc = cli("merge", out, a, b, check=True)
    assert "2 cells, 1 ab experiments, 1 probes" in proc.stdout and "3 cells in" in proc.stdout
    merged = Store(out)
    rows = merged.rows(latest=False)
    assert [(r.ctx, r.fingerprint_key) for r in rows] == [(8, "env-a"), (16, "env-a"),
                                                                 (8, "env-b")]
    assert rows[0].details["merged_from"] == {"file": "a.db", "id": 1}
    assert rows[0].samples_ms == [1.0, 2.0, 3.0]
    sessions = merged.db.execute("SELECT experiment_id, idx FROM ab_sessions").fetchall()
    assert sessions == [(1, 0), (1, 1), (1, 2)]
    assert merged.ab_summaries() == [{"id": 1, "speedup": 2.0}]
    merged.close()
    # merging again adds nothing; a source is never written
    proc = cli("merge", out, a, b, check=True)
    assert proc.stdout.count("nothing new") == 2 and "3 cells in" in proc.stdout
    assert json.loads(cli("show", "--db", a, "--json", check=True).stdout)[0].get(
        "details", {}).get("merged_from") is None


@pytest.mark.parametrize("case, message", [
    ("missing", "no results database at"), ("not-sqlite", "cannot use results database"),
    ("other-sqlite", "not a floorline results database"), ("self", "both the target and a source"),
])
def test_merge_refuses_what_is_not_a_results_database(tmp_path, cli, case, message):
    out, source = tmp_path / "out.db", tmp_path / "in.db"
    if case == "not-sqlite":
        source.write_text("hello, not a database" * 100)
    elif case == "other-sqlite":
        sqlite3.connect(source).execute("CREATE TABLE t (x)")
    elif case == "self":
        source = out
    proc = cli("merge", out, source)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_readers_open_a_read_only_database_and_write_nothing(tmp_path, cli):
    import os
    import stat

    db = tmp_path / "r.db"
    store = Store(db)
    store.add(cell(8), {"torch": "x"}, "env-a")
    store.close()
    before = db.read_bytes()
    os.chmod(db, stat.S_IRUSR)
    os.chmod(tmp_path, stat.S_IRUSR | stat.S_IXUSR)  # no journal can be made beside it either
    try:
        assert "m" in cli("show", "--db", db, check=True).stdout
        assert len(Store(db, read_only=True).rows()) == 1
    finally:
        os.chmod(tmp_path, stat.S_IRWXU)
        os.chmod(db, stat.S_IRUSR | stat.S_IWUSR)
    assert db.read_bytes() == before


@pytest.mark.parametrize("content", [b"", b"not a database at all" * 50])
def test_show_refuses_a_file_that_is_not_a_results_database(tmp_path, cli, content):
    db = tmp_path / "r.db"
    db.write_bytes(content)
    proc = cli("show", "--db", db)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("not a floorline results database" in proc.stderr if not content
            else "cannot use results database" in proc.stderr)
    assert db.read_bytes() == content  # nothing written into it


def test_a_database_from_before_schema_2_is_shown_and_merged_without_being_written(tmp_path,
                                                                                    cli):
    old, out = tmp_path / "old.db", tmp_path / "out.db"
    store = Store(old)
    store.add(cell(8), {"torch": "x"}, "env-a")
    for table in ("ab_sessions", "ab_experiments", "explanations", "probes"):
        store.db.execute(f"DROP TABLE {table}")
    store.db.execute("PRAGMA user_version = 1")
    store.close()
    before = old.read_bytes()
    assert "m" in cli("show", "--db", old, check=True).stdout
    reader = Store(old, read_only=True)
    assert len(reader.rows()) == 1 and reader.ab_summaries() == [] and reader.probes() == {}
    reader.close()
    assert "1 cells" in cli("merge", out, old, check=True).stdout
    assert old.read_bytes() == before


COMMITTED = Path(__file__).parents[1] / "bench" / "results" / "h200-fleet" / "h200_fleet.db"


def test_a_committed_database_reads_as_its_raw_rows_and_new_ones_extend_its_tables(tmp_path):
    """A database from before runs were recorded (schema 3) reads as its rows, each of no run,
    and a new database's tables are its tables with the run's id added."""
    copy = tmp_path / "fleet.db"
    shutil.copy(COMMITTED, copy)  # a copy: even reading a WAL database may touch files beside it
    raw = sqlite3.connect(copy)
    raw.row_factory = sqlite3.Row
    expected = []
    for r in raw.execute("SELECT * FROM cells ORDER BY id"):
        row = dict(r)
        for k in ("samples_ms", "fingerprint", "details"):
            row[k] = json.loads(row[k])
        expected.append({**row, "run_id": None})
    raw.row_factory = None
    rows = Store(copy, read_only=True).rows(latest=False)
    assert len(rows) == len(expected) > 0
    assert [r.as_dict() for r in rows] == expected
    Store(tmp_path / "new.db").close()
    new = sqlite3.connect(tmp_path / "new.db")
    for table in ("cells", "ab_experiments", "ab_sessions", "explanations", "probes"):
        info = f"PRAGMA table_info({table})"
        old = raw.execute(info).fetchall()
        added = ([(len(old), "details", "TEXT", 0, None, 0)] if table == "ab_sessions"  # schema 6
                 else [(len(old), "run_id", "INTEGER", 0, None, 0)])  # schema 4
        assert new.execute(info).fetchall() == old + added
    index = "PRAGMA index_info(cells_by_key)"
    assert new.execute(index).fetchall() == raw.execute(index).fetchall()


def test_the_fraction_of_the_measured_floor_comes_from_the_environments_probe(tmp_path):
    store = Store(tmp_path / "r.db")
    store.add(cell(8), {"torch": "x"}, "env-a")
    store.add(cell(8), {"torch": "y"}, "env-b")
    store.add_probe("cpu", {"stream_read_gbps": 300.0}, {"torch": "x"}, "env-a")
    probed, unprobed = store.rows()
    # 300 MB moved at a measured 300 GB/s takes 1 ms; the step's median is 2 ms
    assert probed.fraction_of_measured(store.probes()) == pytest.approx(0.5)
    assert unprobed.fraction_of_measured(store.probes()) is None


def measured(path, ab=False):
    """A database of two measured cells (and an A/B experiment of one session)."""
    store = Store(path)
    store.add(cell(8), {"torch": "x"}, "env-a")
    store.add(cell(16), {"torch": "x"}, "env-a")
    if ab:
        experiment = store.start_ab({"a": "p", "b": "q", "model": "m", "ctx": 8, "gpu": "l4",
                                     "paired": True}, {"torch": "x"}, "env-a")
        store.add_ab_session(experiment, Session(0))
    store.close()
    return path


def edit(path, *statements):
    db = sqlite3.connect(path)
    db.executescript(";".join(statements))
    db.close()


@pytest.mark.parametrize("change, fragment", [
    ("total_bytes = -5, floor_ms = -1", "cells row 2: valid with floor_ms -1.0, total_bytes -5"),
    ("median_ms = 0", "cells row 2: valid with median_ms 0.0"),
    ("median_ms = 'fast'", "cells row 2: median_ms is not a number but 'fast'"),
    ("status = 'unsteady', median_ms = -2", "cells row 2: unsteady with median_ms -2.0"),
])
def test_a_merge_checks_every_row_and_writes_nothing_where_one_fails(tmp_path, cli, change,
                                                                     fragment):
    good, bad = measured(tmp_path / "good.db"), measured(tmp_path / "bad.db")
    edit(bad, f"UPDATE cells SET {change} WHERE id = 2")
    out = tmp_path / "out.db"
    proc = cli("merge", out, good, bad)  # the first source is sound: all or nothing
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"floorline: error: {bad}: {fragment}")
    assert proc.stderr.endswith("; nothing was merged\n")
    assert not list(tmp_path.glob("out.db*"))  # the target it made is gone
    measured(out)  # a target that was there keeps its rows
    before = Store(out, read_only=True).rows(latest=False)
    assert cli("merge", out, good, bad).returncode == 2
    assert Store(out, read_only=True).rows(latest=False) == before


def test_a_merge_refuses_a_column_the_target_lacks_and_fills_one_only_the_target_has(tmp_path,
                                                                                      cli):
    source = measured(tmp_path / "in.db", ab=True)
    extra = measured(tmp_path / "extra.db")
    edit(extra, "ALTER TABLE cells ADD COLUMN note TEXT")
    out = tmp_path / "out.db"
    proc = cli("merge", out, extra)
    assert proc.returncode == 2 and proc.stderr == (
        f"floorline: error: {extra}: cells has column(s) note that {out} lacks, so merging would "
        "drop their values; nothing was merged\n")
    # the target's own columns take their defaults, and a write it refuses names the target
    Store(out).close()
    edit(out, "ALTER TABLE cells ADD COLUMN note TEXT NOT NULL DEFAULT 'mine'",
         "ALTER TABLE ab_sessions ADD COLUMN tag TEXT")
    assert "2 cells, 1 ab experiments" in cli("merge", out, source, check=True).stdout
    assert sqlite3.connect(out).execute("SELECT note FROM cells").fetchall() == [("mine",)] * 2
    strict = tmp_path / "strict.db"
    Store(strict).close()
    edit(strict, "DROP TABLE ab_sessions", "CREATE TABLE ab_sessions (experiment_id INTEGER, "
         "idx INTEGER, status TEXT, reason TEXT, first_arm TEXT, ms_a REAL, ms_b REAL, "
         "ratio REAL, samples_a TEXT, samples_b TEXT, finished_at TEXT, details TEXT, "
         "tag TEXT NOT NULL)")
    proc = cli("merge", strict, source)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"floorline: error: cannot write to results database {strict}: NOT NULL constraint "
        "failed: ab_sessions.tag")
    assert Store(strict, read_only=True).rows() == []  # rolled back, and kept: it was there
