"""The report: from a small database, from an empty one, and rendered in a real browser."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import run_cli
from floorline.measure.cell import INVALID, VALID, CellKey, CellResult
from floorline.report.build import build_report
from floorline.store import Store


def small_db(path):
    store = Store(path)
    for i, (ctx, p) in enumerate([(128, "hf-eager"), (512, "hf-eager"), (128, "hf-static"), (512, "hf-static")]):
        median = 2.0 + i
        store.add(CellResult(CellKey("tiny-llama", ctx, p, 8, 2), "l4", VALID, None,
                             [median] * 8, {"median_ms": median, "p10_ms": median - 0.1,
                                            "p90_ms": median + 0.1, "mean_ms": median, "n": 8},
                             {"floor_ms": 0.1 + ctx / 1e4, "total_bytes": 10**6, "peak_gbps": 300,
                              "weight_format": "bf16", "kv_dtype": "bf16"}),
                  {"device": "cpu: test", "torch": "x"}, "env")
    parts = {"floor_ms": 0.1, "lost_in_kernels_ms": 0.5, "other_kernels_ms": 0.4, "launch_and_idle_ms": 1.0}
    store.add_explanation({"model": "tiny-llama", "ctx": 128, "path": "hf-eager", "gpu": "l4",
                           "decomposition": {**parts, "median_ms": 2.0}}, {"device": "cpu: test"}, "env")
    store.add(CellResult(CellKey("tiny-llama", 4096, "hf-eager", 8, 2), "l4", INVALID,
                         "context above the model's limit: test"), {"device": "cpu: test"}, "env")
    return path


def test_report_from_a_small_database(tmp_path):
    written = build_report(small_db(tmp_path / "r.db"), tmp_path / "out")
    assert len(written["figures"]) == 5
    assert any("no A/B experiment" in m for m in written["missing"])
    assert any("no quantised cells" in m for m in written["missing"])
    page = (tmp_path / "out" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 5  # self-contained
    assert "context above the model&#x27;s limit: test" in page
    assert "Drawn from cells 1, 2, 3, 4 of this database" in page
    md = (tmp_path / "out" / "report.md").read_text()
    for name in written["figures"]:
        assert f"]({name})" in md and (tmp_path / "out" / name).stat().st_size > 1000


def test_quantised_cells_fill_their_figure(tmp_path):
    db = small_db(tmp_path / "r.db")
    Store(db).add(CellResult(CellKey("tiny-llama", 128, "hf-eager", 8, 2), "l4", VALID, None, [1.0],
                             {"median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "mean_ms": 1.0, "n": 1},
                             {"floor_ms": 0.05, "total_bytes": 10**5, "peak_gbps": 300,
                              "weight_format": "nf4", "kv_dtype": "bf16"}), {"device": "cpu: test"}, "env")
    written = build_report(db, tmp_path / "out")
    assert not any("quantised" in m for m in written["missing"])
    assert "Drawn from cells 6 of this database" in (tmp_path / "out" / "report.md").read_text()


def test_report_from_an_empty_database(tmp_path):
    db = tmp_path / "empty.db"
    Store(db).close()
    proc = run_cli("report", "--db", db, "--out", tmp_path / "out", check=True)
    assert "missing: figure 1: no valid cells yet" in proc.stderr
    page = (tmp_path / "out" / "index.html").read_text()
    assert page.count("Missing:") >= 4 and "<h2>Cells</h2><p class='missing'>none</p>" in page


def test_report_bad_input(tmp_path):
    proc = run_cli("report", "--db", tmp_path / "none.db")
    assert proc.returncode == 2 and "no results database" in proc.stderr


def chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install chromium (.ci/run does)")
        pytest.skip("chromium is not installed here")
    return [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
            f"--user-data-dir={os.environ.get('TMPDIR', '/tmp')}/floorline-chromium-{os.getpid()}"]


def test_every_image_loads_in_a_browser(tmp_path):
    build_report(small_db(tmp_path / "r.db"), tmp_path / "out")
    url = (tmp_path / "out" / "index.html").as_uri()
    dom = subprocess.run(chromium() + ["--virtual-time-budget=5000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120).stdout
    images = re.findall(r"<img[^>]*>", dom)
    assert len(images) == 5
    assert all('data-loaded="1"' in img and "data-broken" not in img for img in images)
    shot = tmp_path / "shot.png"
    subprocess.run(chromium() + ["--window-size=1200,900", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000
