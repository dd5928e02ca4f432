"""The report: from a small database, from an empty one, and rendered in a real browser."""

import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from floorline.records import INVALID, VALID, CellKey, CellResult
from floorline.report.build import build_report
from floorline.store import CellRow, Store

RESULTS = Path(__file__).parents[1] / "bench" / "results"


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
    assert written["figures"][0] == "fig1_headline.png" and len(written["figures"]) == 7
    assert written["figures"][-1] == "fig9_ladders.png"  # every panel, after the body
    assert any("no A/B experiment" in m for m in written["missing"])
    assert any("no quantised cells" in m for m in written["missing"])
    page = (tmp_path / "out" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 7  # self-contained
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
    assert len(lines) == 11  # every figure says what fills it
    for line in lines:  # a whole sentence naming the command that fills it
        assert line.endswith(".") and "`floorline " in line, line
    page = (tmp_path / "out" / "index.html").read_text()
    assert "`" not in page and page.count("<code>floorline ") >= 6
    # Each empty table says why it is empty and which command fills it.
    assert page.count("class='missing'") == 11 + 7
    md = (tmp_path / "out" / "report.md").read_text()
    assert "*This table is empty: each valid cell on a GPU of the catalogue" in md
    assert "*This database holds no A/B experiment: `floorline ab --a " in md


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
    dom = subprocess.run(chromium() + ["--window-size=1200,900", "--virtual-time-budget=5000",
                                       "--dump-dom", url],
                         capture_output=True, text=True, timeout=120).stdout
    images = re.findall(r"<img[^>]*>", dom)
    assert len(images) == 7
    assert all('data-loaded="1"' in img and "data-broken" not in img for img in images)
    # The first screen holds the whole headline, at its own size.
    bottom, scale = re.search(r'data-bottom="([\d.]+)" data-scale="([\d.]+)"', images[0]).groups()
    assert float(bottom) <= 900 and float(scale) == 1
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
    store.add(*cell("m", 128, "bnb-nf4", 20.0, 0.3, weight_format="nf4"))  # slower than engine
    rows = store.rows(latest=False)
    (panel,) = ladder(rows)
    # slowest first
    assert [b["path"] for b in panel["bars"]] == ["bnb-nf4", "hf-eager", "engine", "engine-int4"]
    assert [b["ms"] for b in panel["bars"]] == [20.0, 11.0, 2.0, 1.5]  # hf-eager: median of 2
    assert panel["floor_ms"] == 1.0

    fig, ids, missing = headline(rows)
    # bnb-nf4, a quantised path slower than a 16-bit one, is left to the small multiples.
    assert missing is None and ids == [2, 3, 4, 5]
    ax, table = fig.axes
    bars = [p for p in ax.patches if p.get_width() > 0]
    # Each bar from its own floor to its ms, quantised ones hatched.
    assert [(p.get_x(), p.get_x() + p.get_width()) for p in bars] == [
        (1.0, 11.0), (1.0, 2.0), (0.4, 1.5)]
    assert [bool(p.get_hatch()) for p in bars] == [False, False, True]
    assert [t.get_text() for t in table.texts] == [
        "11.00", f"{100 * 1.0 / 11.0:.1f}%", "2",
        "2.00", f"{100 * 1.0 / 2.0:.1f}%", "1",
        "1.50", f"{100 * 0.4 / 1.5:.1f}%", "1"]
    assert [t.get_text() for t in table.get_xticklabels()] == ["ms/step", "of floor", "runs"]
    floor_lines = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(floor_lines) == 1 and floor_lines[0].get_xdata()[0] == 1.0
    left, right = ax.get_xlim()
    assert left < 0.4 and right > 11.0 and ax.get_xscale() == "log"  # 0.4 to 11 ms: 27x
    assert "not drawn: 1 quantised path slower" in ax.get_xlabel()


def test_the_headline_of_the_h200_data_fits_a_readme():
    """One panel, at README width and a few hundred pixels tall, from the committed results of
    every model and context: Qwen2.5-7B at ctx 2048, the engine's formats among its paths."""
    from PIL import Image

    from floorline.report.figures import png
    from floorline.report.headline import headline

    rows = Store(RESULTS / "merged" / "h200_all.db", read_only=True).rows(latest=False)
    fig, _, _ = headline(rows)
    assert fig.get_suptitle().startswith("qwen2.5-7b on h200, ctx 2048")
    paths = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert {"hf-eager", "engine", "engine-fp8", "engine-int4"} <= set(paths)
    width, height = Image.open(io.BytesIO(png(fig))).size
    assert 850 <= width <= 950 and 300 <= height <= 600


def test_the_readme_headline_figure_shows_the_readme_table():
    from PIL import Image

    from floorline.report.figures import png
    from floorline.report.headline import headline, quoted
    from test_quotes import quote_tables

    tables = quote_tables()
    sources = [tables.rows_of(name, tables.RESULTS)[0] for name in tables.HEADLINE_SOURCES["h200"]]
    fig, _, _ = headline(quoted(sources, *tables.HEADLINE, tables.HEADLINE_PATHS))
    ax, table = fig.axes
    cells = [t.get_text() for t in table.texts]  # ms/step, of floor, runs: a row per bar
    drawn = {t.get_text(): cells[3 * i:3 * i + 2] for i, t in enumerate(ax.get_yticklabels())}
    # | path | GPU | ms/step | of the floor | J/token | from |
    rows = [line.strip("| ").split(" | ")
            for line in tables.headline(("h200",)).splitlines()[2:]]
    assert {path: [ms.split()[0], fraction] for path, _, ms, fraction, *_ in rows} == drawn
    width, height = Image.open(io.BytesIO(png(fig))).size
    assert 850 <= width <= 950 and 300 <= height <= 600


def test_a_cpu_report_suggests_only_what_runs_on_a_cpu(tmp_path, monkeypatch):
    from floorline.paths import parse_path, unavailable
    from floorline.report import here

    monkeypatch.setattr(here, "device", lambda: "cpu")
    db = tmp_path / "empty.db"
    Store(db).close()
    written = build_report(db, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    commands = re.findall(r"`(floorline [^`]*)`", md)
    named = [p for c in commands
             for p in re.findall(r"--(?:a|b|path|paths) ([\w+,.-]+)", c)
             for p in p.split(",")]
    assert {"engine", "engine-int4"} <= set(named)  # the A/B, quantised and quality suggestions
    assert [p for p in named if unavailable(parse_path(p), "cpu")] == []
    assert any("floorline ab --a hf-eager --b engine" in m for m in written["missing"])
    monkeypatch.setattr(here, "device", lambda: "cuda")
    assert here.ab_command() == "`floorline ab --a hf-static --b hf-static+graphs`"


def test_ratios_spanning_decades_are_on_a_log_axis():
    from floorline.report.figures import ab_forest

    fig, _, _ = ab_forest([{"id": 1, "a": "hf-eager", "b": "engine", "model": "m", "ctx": 128,
                            "gpu": "l4", "sessions": 10, "speedup": 30.0, "ci_low": 28.0,
                            "ci_high": 32.0}])
    (ax,) = fig.axes
    assert ax.get_xscale() == "log"
    # The study's 1.028x and 1.259x stay apart beside a 30x ratio, each labelled.
    x = [ax.transData.transform((v, 0))[0] for v in (1.028, 1.259)]
    assert x[1] - x[0] > 20
    assert {"1.03x", "1.26x", "30x"} <= {t.get_text() for t in ax.texts}


def all_figures(tmp_path):
    """Every figure of the report, drawn from a database that fills each but quality's."""
    from floorline.report.build import FIGURES, read_sources

    db = small_db(tmp_path / "r.db")
    store = Store(db)
    store.add(*cell("tiny-llama", 128, "engine-int4", 1.0, 0.05, weight_format="engine-int4-g128"))
    for ctx, path, ms in ((128, "engine", 1.5), (512, "engine", 1.8)):
        result, env, key = cell("tiny-llama", ctx, path, ms, 0.1)
        result.details["energy"] = {"joules_per_token": ms / 2, "error_bound": 0.002}
        store.add(result, env, key)
    sources = read_sources(store)
    sources["ab"] = [{"id": 1, "a": "hf-eager", "b": "engine", "model": "tiny-llama", "ctx": 128,
                      "gpu": "l4", "sessions": 10, "speedup": 2.0, "ci_low": 1.9, "ci_high": 2.1}]
    drawn = {key: draw(sources[source])[0] for key, _, source, draw in FIGURES}
    return {key: fig for key, fig in drawn.items() if fig is not None}


def test_no_legend_over_data_and_hatching_means_quantised(tmp_path):
    figures = all_figures(tmp_path)
    assert set(figures) == {"headline", "fraction", "context", "ab", "quantised",
                            "decomposition", "energy", "ladders"}
    for key, fig in figures.items():
        fig.canvas.draw()
        legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        assert legends, key
        for legend in legends:
            box = legend.get_window_extent()
            assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes), key
    ax = figures["quantised"].axes[0]
    hatched = [bool(p.get_hatch()) for p in ax.patches]
    formats = [t.get_text() for t in ax.get_yticklabels()]
    # the study's bf16 bar is the only one not quantised, and the only one not hatched
    assert [not h for h in hatched] == ["bf16" in f for f in formats]


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


def test_the_verify_figure_is_each_steps_time_over_the_one_token_steps():
    from floorline.paths import verify_tokens
    from floorline.report.figures import NO_VERIFY, verify_cost
    from floorline.report.headline import ladder

    def cell(id, path, ms):
        return CellRow(id=id, model="m", ctx=2048, path=path, steps=64, warmup=0, gpu="h200",
                       fingerprint_key="k", finished_at="x", status="valid", median_ms=ms,
                       total_bytes=100, floor_ms=1.0, weight_format="bf16")

    assert (verify_tokens("engine"), verify_tokens("engine-int4+verify16")) == (1, 16)
    assert verify_cost([cell(1, "engine", 4.0)]) == (None, [], NO_VERIFY)
    cells = [cell(1, "engine", 4.0), cell(2, "engine+verify8", 4.6),
             cell(3, "engine+verify16", 5.2), cell(4, "hf-eager+verify2", 9.0)]
    fig, ids, missing = verify_cost(cells)
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("engine")]
    assert line.get_xdata().tolist() == [1, 8, 16]
    assert line.get_ydata().tolist() == pytest.approx([1.0, 4.6 / 4.0, 5.2 / 4.0])
    assert ids == [1, 2, 3] and missing is None  # a verify cell without its one-token step: out
    # the ladders keep to one-token steps
    assert [b["path"] for b in ladder(cells)[0]["bars"]] == ["engine"]


def test_the_studys_cells_and_ab_beside_this_databases(tmp_path):
    # An H100 database with the study's headline cell (hf-eager, Qwen2.5-7B, ctx 2048) in two
    # runs of one environment, and the CUDA Graphs A/B there: each beside the study's figure;
    # the L4's cells say not measured.
    from floorline.hardware import lookup
    from floorline.models import resolve_model
    from floorline.traffic import floor

    f = floor(resolve_model("qwen2.5-7b"), lookup("h100-sxm5"), 2048)
    store = Store(tmp_path / "r.db")
    for median in (17.0, 18.0):
        store.add(CellResult(CellKey("qwen2.5-7b", 2048, "hf-eager", 64, "auto"), "h100-sxm5",
                             VALID, None, [median] * 64,
                             {"median_ms": median, "p10_ms": median, "p90_ms": median,
                              "mean_ms": median, "n": 64},
                             {"floor_ms": f.floor_ms, "floor_ms_all_params": f.floor_ms_all_params,
                              "total_bytes": f.total_bytes, "peak_gbps": 3350,
                              "weight_format": "bf16", "kv_dtype": "bf16"}),
                  {"device": "NVIDIA H100 80GB HBM3", "code": {}}, "env")
    plan = {"a": "hf-static", "b": "hf-static+graphs", "model": "qwen2.5-7b", "ctx": 2048,
            "gpu": "h100-sxm5", "paired": True}
    ab = store.start_ab(plan, {"device": "NVIDIA H100 80GB HBM3"}, "env")
    store.finish_ab(ab, {**plan, "speedup": 4.5, "ci_low": 4.25, "ci_high": 4.75, "sessions": 10,
                         "sentence": "x"})
    # where the step goes, by an explain of the same cell: 1284 kernels, 46 ms of 53.8 idle
    explained = {"model": "qwen2.5-7b", "ctx": 2048, "path": "hf-eager", "gpu": "h100-sxm5",
                 "kernels_per_step": 1284.0,
                 "decomposition": {"median_ms": 53.76, "busy_union_ms": 7.78, "kernel_ms": 7.78,
                                   "floor_ms": 4.26, "lost_in_kernels_ms": 1.74,
                                   "other_kernels_ms": 1.78, "launch_and_idle_ms": 45.98}}
    store.add_explanation(explained, {"device": "NVIDIA H100 80GB HBM3"}, "env")
    store.close()
    build_report(tmp_path / "r.db", tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    published = f.floor_ms_all_params / 0.27  # the study's 27% of the floor, as ms
    row = next(line for line in md.splitlines() if line.startswith("| h100-sxm5 | qwen2.5-7b"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    fraction = (f.floor_ms_all_params / 17 + f.floor_ms_all_params / 18) / 2  # median of two
    assert cells[4:] == [f"{published:.4g}", "27.0%", "17.50 (median of 2 runs, 17.00-18.00)",
                         f"{fraction:.1%}", "explain 1: the GPU busy 7.78 ms of 53.76; 45.98 ms "
                         f"launching and idle over 1284 kernels, {45.98e3 / 1284:.1f} us each"]
    assert md.count("| l4 | qwen2.5-7b | 2048 |") == 4 and md.count("| not measured |") == 5
    assert ("| h100-sxm5 | 2048 | eager vs CUDA graphs (hf-static vs hf-static+graphs) | "
            "1.259x (1.253-1.267, N=10) | 4.500x (4.250-4.750, N=10; qwen2.5-7b) |") in md
    # the figure of fractions: the same cell measured here, a hollow star beside the study's
    from floorline.report.figures import fraction_vs_bandwidth

    fig, _, _ = fraction_vs_bandwidth(Store(tmp_path / "r.db", read_only=True).rows())
    here = [c for c in fig.axes[0].collections
            if c.get_label() == "the study's cell, measured here"]
    assert len(here) == 1 and here[0].get_offsets().tolist() == [
        [3350, pytest.approx(f.floor_ms_all_params / 18.0)]]  # the newest row
