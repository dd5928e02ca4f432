"""floorline's cache directory (written GGUF files, kernel tuning tables, fetched models), and a
home for the libraries' caches where the user has none."""

from __future__ import annotations

import atexit
import getpass
import os
import shutil
import sys
import tempfile
from pathlib import Path

from floorline.errors import FloorlineError


def cache_dir() -> Path:
    if "FLOORLINE_CACHE" not in os.environ:
        settle_home()
    return Path(os.environ.get("FLOORLINE_CACHE", "~/.cache/floorline")).expanduser()


def settle_home() -> None:
    """Where no home directory can be determined (HOME unset and a user id with no passwd entry,
    as containers run arbitrary ids), HOME becomes a folder of this user's own in the system's
    temporary directory, for this process and those it starts: floorline's cache, Triton's,
    transformers' and matplotlib's all live under it. Says so in one line; once HOME is set,
    later calls find it and say nothing."""
    settle_user_name()
    try:
        Path.home()
        return
    except (RuntimeError, KeyError):  # pathlib's "Could not determine home directory"
        pass
    uid = os.getuid()
    missing = (f"no home directory for user id {uid} (HOME is unset and the id has no passwd "
               "entry)")
    home = Path(tempfile.gettempdir()) / f"floorline-home-{uid}"
    try:
        home.mkdir(mode=0o700, exist_ok=True)
        owned = not home.is_symlink() and home.stat().st_uid == uid
    except OSError as e:
        raise FloorlineError(f"{missing}, and {home} cannot be made ({e.strerror}): set HOME to a "
                             "writable folder") from None
    if not owned:  # another user's folder (or a link) in a shared temporary directory
        raise FloorlineError(f"{missing}, and {home} belongs to another user: set HOME to a "
                             "writable folder")
    os.environ["HOME"] = str(home)
    print(f"floorline: {missing}: caches go under {home} (set HOME, or FLOORLINE_CACHE for "
          "floorline's own, to choose)", file=sys.stderr)


def settle_user_name() -> None:
    """A user id with no passwd entry has no name, and getpass.getuser() raises KeyError for it:
    torch before 2.13 asks for it unguarded when its compiler is imported, to name that cache's
    folder (pytorch/pytorch#140765), which transformers does while building a model. Such a user
    is then named uid_<id>, torch's own later fallback, through USER, for this process and those
    it starts. A name the environment gives is kept."""
    try:
        getpass.getuser()
    except (KeyError, OSError):  # OSError from Python 3.13 on
        os.environ["USER"] = f"uid_{os.getuid()}"


def quiet_matplotlib_config() -> None:
    """matplotlib warns in two lines, then uses a temporary folder, where its configuration or
    cache folder is not writable (another user's home, a read-only one): the same, chosen here
    before matplotlib is imported, without the warning."""
    if "MPLCONFIGDIR" in os.environ:
        return
    home = Path.home()
    folders = [Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "matplotlib",
               Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "matplotlib"]
    try:
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
        if all(os.access(folder, os.W_OK) for folder in folders):
            return
    except OSError:
        pass
    os.environ["MPLCONFIGDIR"] = temporary = tempfile.mkdtemp(prefix="matplotlib-")
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
