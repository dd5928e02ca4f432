"""The report: from a small database, from an empty one, and rendered in a real browser."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import run_cli
from floorline.records import INVALID, VALID, CellKey, CellResult
from floorline.report.build import build_report
from floorline.store import Store


def small_db(path):
    store = Store(path)
    grid = [(128, "hf-eager"), (512, "hf-eager"), (128, "hf-static"), (512, "hf-static")]
    for i, (ctx, p) in enumerate(grid):
        median = 2.0 + i
        store.add(CellResult(CellKey("tiny-llama", ctx, p, 8, 2), "l4", VALID, None,
                             [median] * 8, {"median_ms": median, "p10_ms": median - 0.1,
                                            "p90_ms": median + 0.1, "mean_ms": median, "n": 8},
                             {"floor_ms": 0.1 + ctx / 1e4, "total_bytes": 10**6, "peak_gbps": 300,
                              "weight_format": "bf16", "kv_dtype": "bf16"}),
                  {"device": "cpu: test", "torch": "x"}, "env")
    parts = {"floor_ms": 0.1, "lost_in_kernels_ms": 0.5, "other_kernels_ms": 0.4,
             "launch_and_idle_ms": 1.0}
    store.add_explanation({"model": "tiny-llama", "ctx": 128, "path": "hf-eager", "gpu": "l4",
                           "decomposition": {**parts, "median_ms": 2.0}},
                          {"device": "cpu: test"}, "env")
    store.add(CellResult(CellKey("tiny-llama", 4096, "hf-eager", 8, 2), "l4", INVALID,
                         "context above the model's limit: test"), {"device": "cpu: test"}, "env")
    return path


def test_report_from_a_small_database(tmp_path):
    written = build_report(small_db(tmp_path / "r.db"), tmp_path / "out")
    assert len(written["figures"]) == 6 and written["figures"][0] == "fig1_headline.png"
    assert any("no A/B experiment" in m for m in written["missing"])
    assert any("no quantised cells" in m for m in written["missing"])
    page = (tmp_path / "out" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 6  # self-contained
    assert "`" not in page  # code spans are <code>, not Markdown backticks
    assert "context above the model&#x27;s limit: test" in page
    assert "Drawn from cells 1, 2, 3, 4 of this database" in page
    md = (tmp_path / "out" / "report.md").read_text()
    for name in written["figures"]:
        assert f"]({name})" in md and (tmp_path / "out" / name).stat().st_size > 1000


def test_quantised_cells_fill_their_figure(tmp_path):
    db = small_db(tmp_path / "r.db")
    Store(db).add(CellResult(CellKey("tiny-llama", 128, "hf-eager", 8, 2), "l4", VALID, None, [1.0],
                             {"median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "mean_ms": 1.0,
                              "n": 1},
                             {"floor_ms": 0.05, "total_bytes": 10**5, "peak_gbps": 300,
                              "weight_format": "nf4", "kv_dtype": "bf16"}),
                  {"device": "cpu: test"}, "env")
    written = build_report(db, tmp_path / "out")
    assert not any("quantised" in m for m in written["missing"])
    assert "Drawn from cells 6 of this database" in (tmp_path / "out" / "report.md").read_text()


def test_report_from_an_empty_database(tmp_path):
    db = tmp_path / "empty.db"
    Store(db).close()
    proc = run_cli("report", "--db", db, "--out", tmp_path / "out", check=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("missing: ")]
    assert lines[0] == ("missing: figure 1: There are no valid cells yet: `floorline sweep` "
                        "measures them.")
    assert len(lines) == 8  # every figure says what fills it
    for line in lines:  # a whole sentence naming the command that fills it
        assert line.endswith(".") and "`floorline " in line, line
    page = (tmp_path / "out" / "index.html").read_text()
    assert "`" not in page and page.count("<code>floorline ") >= 6
    # Each empty table says why it is empty and which command fills it.
    assert page.count("class='missing'") == 8 + 6
    md = (tmp_path / "out" / "report.md").read_text()
    assert "*This table is empty: each valid cell on a GPU of the catalogue" in md
    assert "*This database holds no A/B experiment: `floorline ab` runs one.*" in md


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
    assert len(images) == 6
    assert all('data-loaded="1"' in img and "data-broken" not in img for img in images)
    shot = tmp_path / "shot.png"
    subprocess.run(chromium() + ["--window-size=1200,900", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000


def cell(model, ctx, path, median, floor_ms, peak=300.0, weight_format="bf16", env="env"):
    return (CellResult(CellKey(model, ctx, path, 8, 2), "l4", VALID, None, [median] * 8,
                       {"median_ms": median, "p10_ms": median, "p90_ms": median,
                        "mean_ms": median, "n": 8},
                       {"floor_ms": floor_ms, "total_bytes": 10**6, "peak_gbps": peak,
                        "weight_format": weight_format, "kv_dtype": "bf16"}),
            {"device": "test"}, env)


def test_headline_bars_and_labels_come_from_the_database(tmp_path):
    from floorline.report.headline import headline, ladder

    store = Store(tmp_path / "h.db")
    store.add(*cell("m", 128, "hf-eager", 30.0, 1.0, env="older code"))  # another class: left out
    store.add(*cell("m", 128, "hf-eager", 10.0, 1.0))
    store.add(*cell("m", 128, "engine", 2.0, 1.0))
    store.add(*cell("m", 128, "engine-int4", 1.5, 0.4, weight_format="engine-int4-g128"))
    store.add(*cell("m", 128, "hf-eager", 12.0, 1.0))  # a second run of the same class
    store.add(CellResult(CellKey("m", 128, "hf-static", 8, 2), "l4", INVALID, "out of memory"),
              {"device": "test"}, "env")
    rows = store.rows(latest=False)
    (panel,) = ladder(rows)
    # slowest first
    assert [b["path"] for b in panel["bars"]] == ["hf-eager", "engine", "engine-int4"]
    assert [b["ms"] for b in panel["bars"]] == [11.0, 2.0, 1.5]  # hf-eager: median of its two runs
    assert [b["quantised"] for b in panel["bars"]] == [False, False, True]
    assert panel["floor_ms"] == 1.0

    fig, ids, missing = headline(rows)
    assert missing is None and ids == [2, 3, 4, 5]
    (ax,) = fig.axes
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert [p.get_width() for p in bars] == [11.0, 2.0, 1.5]
    assert [bool(p.get_hatch()) for p in bars] == [False, False, True]
    # Labels: floor / ms, computed here from the numbers stored above.
    assert [t.get_text() for t in ax.texts] == [
        f"{100 * 1.0 / 11.0:.1f}% of the floor, median of 2 runs",
        f"{100 * 1.0 / 2.0:.1f}% of the floor", f"{100 * 0.4 / 1.5:.1f}% of its floor"]
    assert [t.get_text() for t in ax.texts] == [
        "9.1% of the floor, median of 2 runs", "50.0% of the floor", "26.7% of its floor"]
    floor_lines = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(floor_lines) == 1 and floor_lines[0].get_xdata()[0] == 1.0
    left, right = ax.get_xlim()
    assert left == 0 and right >= 12.0  # linear, and holds the slowest run
    assert ax.get_xscale() == "linear"


def test_axes_fit_a_cpu_bandwidth(tmp_path):
    from floorline.report.figures import fraction_vs_bandwidth
    from floorline.report.headline import headline

    store = Store(tmp_path / "cpu.db")
    store.add(*cell("tiny", 128, "hf-eager", 0.9, 0.03, peak=20.0))
    store.add(*cell("tiny", 128, "engine", 0.3, 0.03, peak=20.0))
    fig, _, _ = fraction_vs_bandwidth(store.rows())
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    assert low < 20.0 and high > 3350.0  # the CPU's cells and the study's H100 both in view
    assert ax.yaxis.get_major_formatter()(0.5, 0) == "50%"
    fig, _, _ = headline(store.rows(latest=False))
    assert fig.axes[0].get_xlim()[1] > 0.9 and [t.get_text() for t in fig.axes[0].texts] == [
        "3.3% of the floor", "10.0% of the floor"]


def test_names_with_markup_are_shown_as_text(tmp_path):
    name = "m[/red]*b*_i_|x`c`<b>&amp;$1$#"
    store = Store(tmp_path / "markup.db")
    store.add(*cell(name, 128, "hf-eager", 2.0, 1.0))
    store.add(*cell(name, 512, "hf-eager", 3.0, 1.1))
    build_report(tmp_path / "markup.db", tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    escaped = r"m\[/red\]\*b\*\_i\_\|x\`c\`\<b\>\&amp;$1$\#"
    assert f"| 1 | {escaped} | 128 |" in md and name not in md
    page = (tmp_path / "out" / "index.html").read_text()
    assert "<td>m[/red]*b*_i_|x<code>c</code>&lt;b&gt;&amp;amp;$1$#</td>" in page
    assert "<b>" not in page
