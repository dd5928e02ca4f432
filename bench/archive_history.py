"""Every row ever committed to a results database of this repository, in one archive database.

    .venv/bin/python bench/archive_history.py    (from the repository root)

Finds every version (git blob) of every *.db under bench/results/, subfolders included, in every
commit reachable from any ref, and merges them oldest first into
bench/results/merged/h200_archive.db with floorline.store.merge, then the working tree's
bench/results/**/*.db. Each version is
merged from a copy named <its path under bench/results/, "/" as "__">@<commit>_<date>.db (the
first commit holding that version, abbreviated, and its date; "@worktree" for the working
tree), so the merged_from of each cell it adds, and the options of a "merge" run made for rows
older than runs, name the file and the commit. A row the archive already holds (by the merge's
identity) is skipped: a row is credited to the oldest version that held it. A source that
cannot be read is named on stderr with the reason and skipped; the archive itself is never a
source, at its path nor at any other (a file named h200_archive.db: where it was kept before).

The archive is rebuilt from scratch in a temporary folder and renamed over the old one, so a
re-run holds the same rows; it is VACUUMed and left in rollback-journal mode (no -wal file).
Prints the versions seen, the rows copied per table, the archive's size (over 30 MB, too big
to commit: a warning and exit status 1) and how many of its cells no database of the working
tree holds, per source.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from floorline.errors import FloorlineError
from floorline.store import IDENTITY, Store, merge

RESULTS = Path("bench/results")
ARCHIVE = RESULTS / "merged" / "h200_archive.db"
MAX_BYTES = 30 * 2**20  # the largest archive worth committing


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def source_name(path: str, tag: str) -> str:
    return f"{Path(path).relative_to(RESULTS).as_posix().replace('/', '__')}@{tag}.db"


def is_archive(path: str, skip: str) -> bool:
    """Whether a database under bench/results/ is the archive: the one at `skip`, or one named
    as the archive is (the archive as committed at an earlier path)."""
    return path == skip or Path(path).name == ARCHIVE.name


def committed_versions(repo: Path, skip: str) -> dict[str, tuple[str, int]]:
    """{blob: (its source name, the index of the first commit holding it, oldest first)} for
    each *.db blob under bench/results/ in any commit but the archive's (is_archive)."""
    versions: dict[str, tuple[str, int]] = {}
    log = git(repo, "log", "--all", "--reverse", "--date-order", "--format=%H %h %cs")
    for index, (commit, short, date) in enumerate(line.split() for line in log.splitlines()):
        for entry in git(repo, "ls-tree", "-r", "-z", commit, "--", str(RESULTS)).split("\0"):
            if not entry:
                continue
            meta, path = entry.split("\t", 1)
            _, kind, blob = meta.split()
            if kind == "blob" and path.endswith(".db") and not is_archive(path, skip):
                versions.setdefault(blob, (source_name(path, f"{short}_{date}"), index))
    return versions


def snapshot(path: Path, copy: Path) -> None:
    """A copy of a working-tree database holding what its WAL file holds, made from copies of
    both so that nothing (not even a -shm file) is written beside the original."""
    shutil.copyfile(path, copy)
    wal = path.with_name(f"{path.name}-wal")
    if wal.exists():
        shutil.copyfile(wal, copy.with_name(f"{copy.name}-wal"))
    db = sqlite3.connect(copy)
    try:
        db.execute("PRAGMA journal_mode = DELETE")  # moves the WAL's pages into the copy
    finally:
        db.close()


def made_by_merging(path: Path) -> bool:
    """Whether a database holds cells that a merge copied from others (as h200_all.db does)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
        try:
            return bool(db.execute("SELECT 1 FROM cells WHERE json_extract(details, "
                                   "'$.merged_from') IS NOT NULL LIMIT 1").fetchone())
        finally:
            db.close()
    except sqlite3.DatabaseError:  # no cells table, or damaged: the merge will say which
        return False


def merge_each(target: Store, sources: list[Path]) -> dict[Path, dict[str, int]]:
    """Merges the sources one by one: {source: rows copied per table} for those merged (one
    that cannot be read is named on stderr and skipped)."""
    reports = {}
    for source in sources:
        try:
            reports[source] = merge(target, [source])[str(source)]
        except FloorlineError as e:
            print(f"skipped {source.name}: {e}", file=sys.stderr)
    return reports


def absent(union: Path, source: Path, scratch: Path) -> int:
    """How many cells of `source` the database `union` lacks: those a merge into a copy of
    it copies."""
    shutil.copyfile(union, scratch)
    store = Store(scratch)
    try:
        return merge(store, [source])[str(source)]["cells"]
    finally:
        store.close()


def print_copied(reports: dict[Path, dict[str, int]]) -> None:
    for source, report in reports.items():
        if any(report.values()):
            print(f"  {source.name}: " + ", ".join(f"{n} {t}" for t, n in report.items() if n))


def main(repo: Path, output: Path) -> int:
    repo, output = repo.resolve(), output.resolve()
    skip = output.relative_to(repo).as_posix() if output.is_relative_to(repo) else ""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        versions = committed_versions(repo, skip)
        first_commit = {}
        for blob, (name, index) in versions.items():
            with open(tmp / name, "wb") as f:
                subprocess.run(["git", "-C", str(repo), "cat-file", "blob", blob], stdout=f,
                               check=True)
            first_commit[tmp / name] = index
        # Oldest first; within a commit, a database merged from others after those others,
        # so that a row is credited to the database that measured it.
        committed = sorted(first_commit, key=lambda s: (first_commit[s], made_by_merging(s)))
        tree = []
        for path in sorted((repo / RESULTS).rglob("*.db")):
            if path.resolve() == output or path.name == ARCHIVE.name:
                continue
            copy = tmp / source_name(path.relative_to(repo).as_posix(), "worktree")
            try:
                snapshot(path, copy)
            except sqlite3.DatabaseError as e:
                print(f"skipped {path.relative_to(repo)}: {e}", file=sys.stderr)
                continue
            tree.append(copy)

        built = tmp / output.name
        archive = Store(built)
        print(f"{len(committed)} committed versions of results databases, rows copied:")
        history = merge_each(archive, committed)
        print_copied(history)
        print(f"{len(tree)} databases of the working tree, rows copied:")
        present = merge_each(archive, tree)
        print_copied(present)
        archive.db.execute("PRAGMA journal_mode = DELETE")
        archive.db.execute("VACUUM")
        held = {t: archive.db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in (*IDENTITY, "ab_sessions")}
        archive.close()

        # The cells that no database of the working tree holds: those a merge into the union
        # of the working tree's databases would copy, of the archive and of each version.
        union = Store(tmp / "working_tree_union.db")
        merge_each(union, list(present))
        union.close()
        scratch = tmp / "scratch.db"
        lost = absent(union.path, built, scratch)
        lost_from = {s: n for s in history if (n := absent(union.path, s, scratch))}

        staged = output.with_name(f".{output.name}.tmp")
        shutil.copyfile(built, staged)
        os.replace(staged, output)

    size = output.stat().st_size
    copied = Counter()
    for report in [*history.values(), *present.values()]:
        copied.update(report)
    print(f"\nblob versions seen: {len(versions)} ({len(versions) - len(history)} unreadable)")
    print("rows copied: " + ", ".join(f"{t} {n}" for t, n in copied.items()))
    print(f"archive: {output} ({size / 2**20:.2f} MiB), holding "
          + ", ".join(f"{t} {n}" for t, n in held.items()))
    print(f"cells of the archive in no database of the working tree: {lost}, held by "
          f"{sum(lost_from.values())} rows of committed versions:")
    for source, n in lost_from.items():
        print(f"  {n:4d} {source.name}")
    if size > MAX_BYTES:
        print(f"{output} is {size / 2**20:.0f} MiB, over the {MAX_BYTES / 2**20:.0f} MiB "
              "worth committing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    sys.exit(main(root, root / ARCHIVE))
