import importlib.util
import subprocess
from pathlib import Path

from floorline.records import VALID, CellKey, CellResult
from floorline.store import Store

SCRIPT = Path(__file__).parents[1] / "bench" / "archive_history.py"


def load_script():
    spec = importlib.util.spec_from_file_location("archive_history", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cell(ctx):
    summary = {"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 3.0, "mean_ms": 2.0, "n": 3}
    return CellResult(CellKey("m", ctx, "hf-eager", 3, 1), "l4", VALID, None, [1.0, 2.0, 3.0],
                      summary, {"floor_ms": 1.0, "total_bytes": 300_000_000}, {"seed": 0})


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


def commit_database(repo, ctx) -> str:
    """Replaces bench/results/r.db with a database holding one cell; returns the commit."""
    db = repo / "bench" / "results" / "r.db"
    db.unlink(missing_ok=True)
    store = Store(db)
    store.add(cell(ctx), {"torch": "x"}, "env-a")
    store.close()
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"ctx {ctx}")
    return git(repo, "rev-parse", "--short", "HEAD")


def test_the_archive_holds_every_committed_version_with_its_file_and_commit(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    git(repo, "init", "-q")
    first = commit_database(repo, 8)
    second = commit_database(repo, 16)  # the cell of ctx 8 is in no database of the tree now
    (repo / "bench" / "results" / "broken.db").write_bytes(b"not a database" * 100)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a damaged database")

    out = tmp_path / "archive.db"
    archive_history = load_script()
    assert archive_history.main(repo, out) == 0
    printed = capsys.readouterr()
    assert "skipped broken.db@" in printed.err
    assert "cells of the archive in no database of the working tree: 1," in printed.out
    rows = {r.ctx: r for r in Store(out, read_only=True).rows(latest=False)}
    assert sorted(rows) == [8, 16]
    assert rows[8].details["merged_from"]["file"].startswith(f"r.db@{first}_")
    assert rows[16].details["merged_from"]["file"].startswith(f"r.db@{second}_")
    assert not out.with_name("archive.db-wal").exists()

    archive_history.main(repo, out)  # a re-run holds the same rows
    assert len(Store(out, read_only=True).rows(latest=False)) == 2


def test_the_archive_at_an_earlier_path_is_never_a_source(tmp_path, capsys):
    """The archive was kept at bench/results/h200_archive.db before it moved: a version of it at
    any path is not merged into the new one."""
    repo = tmp_path / "repo"
    (repo / "bench" / "results" / "old").mkdir(parents=True)
    git(repo, "init", "-q")
    commit_database(repo, 8)
    earlier = Store(repo / "bench" / "results" / "old" / "h200_archive.db")
    earlier.add(cell(32), {"torch": "x"}, "env-a")
    earlier.close()
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "an archive at its earlier path")

    out = repo / "bench" / "results" / "merged" / "h200_archive.db"
    out.parent.mkdir()
    assert load_script().main(repo, out) == 0
    assert sorted(r.ctx for r in Store(out, read_only=True).rows(latest=False)) == [8]
