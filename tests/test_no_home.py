"""floorline run as containers run it: a user id with no passwd entry and no HOME, for which no
home directory can be determined. The commands work, with one line naming where the caches go."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from test_bad_input import checkpoint  # noqa: F401

UID = 4242 + os.getpid() % 1000  # no passwd entry: a user namespace maps it onto this user
NAMES = ("LOGNAME", "USER", "LNAME", "USERNAME")  # where getpass.getuser() looks before passwd


def homeless(*args: str, tmp_path, **popen) -> subprocess.Popen:
    """`floorline ARGS` as UID, with HOME and floorline's cache unset (the suite runs as root in
    CI: a user namespace of its own gives the process an id the passwd file does not know)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "FLOORLINE_CACHE", *NAMES)}
    env["TMPDIR"] = str(tmp_path)  # the fallback home, within the test's folder
    return subprocess.Popen(
        ["unshare", "--user", f"--map-user={UID}", f"--map-group={UID}",
         sys.executable, "-m", "floorline", *args],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        **popen)


@pytest.fixture(scope="module", autouse=True)
def user_namespaces():
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--user", f"--map-user={UID}", "true"], capture_output=True).returncode:
        pytest.skip("this host cannot create a user namespace (unshare --user)")


def said_where_caches_go(err: str, tmp_path) -> None:
    """The command's first line named its home folder, made private, and nothing failed."""
    home = tmp_path / f"floorline-home-{UID}"
    assert err.startswith(f"floorline: no home directory for user id {UID} (HOME is unset and "
                          f"the id has no passwd entry): caches go under {home} ("), err
    assert "internal error" not in err and "Traceback" not in err
    assert (home.stat().st_mode & 0o777) == 0o700
    assert not (tmp_path / "~").exists()  # no library's literal '~' in the working folder


def finished(proc: subprocess.Popen, tmp_path) -> str:
    """The command's stdout, after checking it ended well and said where the caches went."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    said_where_caches_go(err, tmp_path)
    return out


def test_a_sweep_measures_its_cell(tmp_path):
    db = tmp_path / "cells.db"
    finished(homeless("sweep", "--device", "cpu", "--models", "tiny-llama", "--ctx", "16",
                      "--paths", "engine", "--steps", "8", "--warmup", "2", "--db", str(db),
                      tmp_path=tmp_path), tmp_path)
    out = finished(homeless("show", "--db", str(db), "--json", tmp_path=tmp_path), tmp_path)
    [cell] = json.loads(out)
    assert cell["status"] != "invalid" and cell["median_ms"] > 0, cell["reason"]


@pytest.mark.parametrize("home", [False, True])
def test_a_user_with_no_passwd_entry_gets_a_name_libraries_can_ask_for(tmp_path, home):
    # torch before 2.13 asks getpass for it when its compiler is imported, HOME set or not
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", *NAMES)}
    if home:
        env["HOME"] = str(tmp_path)
    ask = ("import getpass; from floorline.localcache import settle_home; settle_home(); "
           "print(getpass.getuser())")
    done = subprocess.run(["unshare", "--user", f"--map-user={UID}", f"--map-group={UID}",
                           sys.executable, "-c", ask], env={**env, "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == f"uid_{UID}\n", done.stderr
    kept = subprocess.run(["unshare", "--user", f"--map-user={UID}", f"--map-group={UID}",
                           sys.executable, "-c", ask],
                          env={**env, "TMPDIR": str(tmp_path), "USER": "robot"},
                          capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0 and kept.stdout == "robot\n", kept.stderr


def test_generate_answers(tmp_path, checkpoint):  # noqa: F811
    out = finished(homeless("generate", "--model", str(checkpoint), "--prompt", "w1 w2",
                            "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4",
                            tmp_path=tmp_path), tmp_path)
    assert out.strip()


def test_serve_starts_and_answers(tmp_path, checkpoint):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = homeless("serve", "--model", str(checkpoint), "--device", "cpu", "--dtype",
                    "float32", "--port", str(port), tmp_path=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not start in 120 s"
                time.sleep(0.5)
        assert answer.status_code == 200
    finally:
        proc.terminate()
    said_where_caches_go(proc.communicate(timeout=60)[1], tmp_path)


def test_a_report_with_a_home_it_cannot_write_prints_no_library_warning(tmp_path):
    # matplotlib's folders under the home cannot be made (files stand where they would go):
    # its own two-line warning would come first
    home = tmp_path / "home"
    home.mkdir()
    (home / ".config").touch()
    (home / ".cache").touch()
    db = Path(__file__).parents[1] / "bench" / "results" / "cpu-demo" / "run1.db"
    env = {**os.environ, "HOME": str(home)}
    env.pop("MPLCONFIGDIR", None)
    env.pop("XDG_CONFIG_HOME", None)
    env.pop("XDG_CACHE_HOME", None)
    done = subprocess.run([sys.executable, "-m", "floorline", "report", "--db", str(db), "--out",
                           str(tmp_path / "report")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote ") and "Traceback" not in done.stderr
    assert "atplotlib" not in done.stderr, done.stderr


def test_a_home_folder_someone_else_planted_is_refused_in_one_line(tmp_path):
    # a link where the folder would be, in a temporary directory other users can write
    (tmp_path / f"floorline-home-{UID}").symlink_to(tmp_path)
    proc = homeless("floor", "--model", "tiny-llama", "--gpu", "l4", "--ctx", "64",
                    tmp_path=tmp_path)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"floorline: error: no home directory for user id {UID}") and \
        "belongs to another user: set HOME to a writable folder" in err, err
