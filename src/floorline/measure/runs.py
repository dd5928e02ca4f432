"""A command's invocation as a run of the results database: what ran, with which options and
label, in which environment; every row it adds names its run (`floorline show --provenance`)."""

from __future__ import annotations

from pathlib import Path

from floorline.measure.fingerprint import fingerprint_key
from floorline.store import Store


def open_run(db: Path, command: str, options: dict, env: dict, label: str | None) -> Store:
    """The results database `db` (made if absent), with `command` begun as a run in `env`, the
    environment its rows are stored with; its options record the database's path."""
    store = Store(db)
    store.begin_run(command, {**options, "db": str(db)}, env, fingerprint_key(env), label)
    return store
