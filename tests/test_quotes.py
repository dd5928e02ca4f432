"""Quoting a figure: the median over the runs of one provenance class with its range and N, or
one run said as such; the documents' quoted blocks are what the committed data gives."""

import importlib.util
from pathlib import Path

from floorline.measure.fingerprint import fingerprint_key
from floorline.records import UNSTEADY, VALID, CellKey, CellResult
from floorline.report.quotes import joules_per_token, mismatches, quote, render
from floorline.store import Store

ROOT = Path(__file__).parents[1]


def quote_tables():
    script = ROOT / "bench" / "quote_tables.py"
    spec = importlib.util.spec_from_file_location("quote_tables", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add(store, ms, env_key, code=True, status=VALID, energy=None):
    key = CellKey("m", 2048, "engine", 64, "auto")
    details = {"energy": energy} if energy else {}
    store.add(CellResult(key, "h200", status, None, [ms] * 4,
                         {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "mean_ms": ms, "n": 4},
                         {"floor_ms": 3.0, "total_bytes": 10**6, "weight_bytes": 9 * 10**5,
                          "kv_bytes": 10**5, "peak_gbps": 1.0, "weight_format": "bf16",
                          "kv_dtype": "bf16"}, details),
              {"device": "h200", **({"code": {}} if code else {})}, env_key)


def test_the_median_over_runs_of_the_newest_class_with_range_and_n(tmp_path):
    store = Store(tmp_path / "r.db")
    add(store, 3.50, "old-kernels")
    for ms in (3.90, 3.82, 3.87, 3.88, 3.86):
        add(store, ms, "new-kernels")
    add(store, 2.0, "new-kernels", status=UNSTEADY)  # never quoted
    rows = store.rows(latest=False)
    q = quote(rows, "m", 2048, "engine")
    assert (q.value, q.low, q.high, q.n, q.klass) == (3.87, 3.82, 3.90, 5, "new-kernels")
    assert q.text(".2f", " ms") == "3.87 ms (median of 5 runs, 3.82-3.90)"
    old = quote(rows, "m", 2048, "engine", klass="old-kernels")
    assert old.text(".2f", " ms") == "3.50 ms (one run)"
    assert quote(rows, "m", 4096, "engine") is None


def test_a_transformers_path_is_one_class_whatever_the_engine_tuned(tmp_path):
    # Three runs alike but for the engine's tuning table (a sweep of new shapes tuned some in
    # between): transformers' steps are pooled, the engine's are not.
    store = Store(tmp_path / "r.db")
    for ms, tuning in ((51.9, "a"), (51.7, "a"), (64.7, "b")):
        env = {"device": "h100", "torch": "2.11", "flags": {},
               "code": {"kernels_sha256": "k", "tuning_sha256": tuning}}
        for path in ("hf-eager", "engine"):
            store.add(CellResult(CellKey("m", 2048, path, 64, "auto"), "h100", VALID, None,
                                 [ms] * 4, {"median_ms": ms, "p10_ms": ms, "p90_ms": ms,
                                            "mean_ms": ms, "n": 4},
                                 {"floor_ms": 3.0, "total_bytes": 10**6, "peak_gbps": 1.0,
                                  "weight_format": "bf16", "kv_dtype": "bf16"}, {}),
                      env, fingerprint_key(env))
    rows = store.rows(latest=False)
    assert quote(rows, "m", 2048, "hf-eager").text(".1f") == "51.9 (median of 3 runs, 51.7-64.7)"
    assert quote(rows, "m", 2048, "engine").text(".1f") == "64.7 (one run)"


def test_a_rewound_session_is_not_pooled_with_one_that_held_every_position(tmp_path):
    # transformers' static cache is read whole: a session of 2627 positions took 9.66 ms where
    # one rewound within 2115 took less; the newest class is quoted alone
    store = Store(tmp_path / "r.db")
    env = {"device": "h100", "flags": {}, "code": {"kernels_sha256": "k", "tuning_sha256": "t"}}
    for ms, details in ((9.66, {}), (9.31, {"rewound_every": 64}), (9.35, {"rewound_every": 64})):
        store.add(CellResult(CellKey("m", 2048, "hf-static+graphs", 64, "auto"), "h100", VALID,
                             None, [ms] * 4, {"median_ms": ms, "p10_ms": ms, "p90_ms": ms,
                                              "mean_ms": ms, "n": 4},
                             {"floor_ms": 3.0, "total_bytes": 10**6, "peak_gbps": 1.0,
                              "weight_format": "bf16", "kv_dtype": "bf16"}, details),
                  env, fingerprint_key(env))
    q = quote(store.rows(latest=False), "m", 2048, "hf-static+graphs")
    assert q.text(".2f") == "9.33 (median of 2 runs, 9.31-9.35)"


def test_rows_from_before_provenance_are_each_run_their_own_class(tmp_path):
    store = Store(tmp_path / "r.db")
    store.begin_run("merge", {}, {}, "same-versions")
    add(store, 3.5, "same-versions", code=False)
    store.begin_run("merge", {}, {}, "same-versions")
    add(store, 3.9, "same-versions", code=False)
    q = quote(store.rows(latest=False), "m", 2048, "engine")
    assert q.n == 1 and q.value == 3.9  # kernels unknown: not pooled with the other run


def test_energy_is_quoted_only_where_the_reading_is_valid(tmp_path):
    store = Store(tmp_path / "r.db")
    reading = {"joules_per_token": 2.4, "mean_watts": 600, "power_limit_w": 700,
               "error_bound": 0.003}
    add(store, 3.9, "k", energy=reading)
    add(store, 3.9, "k", energy={**reading, "joules_per_token": 3.2, "mean_watts": 877})
    add(store, 3.9, "k", energy={"joules_per_token": 2.0, "mean_watts": 600})  # no bound
    q = quote(store.rows(latest=False), "m", 2048, "engine", joules_per_token)
    assert q.n == 1 and q.value == 2.4


def test_a_planted_mismatch_in_a_quoted_block_is_found():
    text = "intro\n<!-- quoted: t -->\n| a | 1.00 |\n<!-- /quoted -->\nend\n"
    assert mismatches(text, {"t": "| a | 1.00 |\n"}) == []
    planted = text.replace("1.00", "1.01")
    assert mismatches(planted, {"t": "| a | 1.00 |\n"}) == ["block 't' differs from the data"]
    assert render(planted, {"t": "| a | 1.00 |\n"}) == text
    assert mismatches("no blocks", {"t": "x\n"}) == ["block 't' is missing"]


def test_the_documents_quote_what_the_committed_data_gives():
    made = quote_tables().blocks()
    assert {doc.name for doc in made} == {"README.md", "results-h200.md", "results-h100.md"}
    for doc, blocks in made.items():
        assert mismatches(doc.read_text(), blocks) == [], doc


def test_the_headline_says_not_measured_for_a_cell_no_database_holds(tmp_path):
    # An H100 database: one steady run of the engine (5.0 ms on a 3.0 ms floor), one unsteady
    # run of engine-int4, nothing else.
    tables = quote_tables()
    store = Store(tmp_path / "x.db")
    for path, status in (("engine", VALID), ("engine-int4", UNSTEADY)):
        store.add(CellResult(CellKey("qwen2.5-7b", 2048, path, 64, "auto"), "h100-sxm5", status,
                             None, [5.0] * 4,
                             {"median_ms": 5.0, "p10_ms": 5.0, "p90_ms": 5.0, "mean_ms": 5.0,
                              "n": 4},
                             {"floor_ms": 3.0, "total_bytes": 10**6, "weight_bytes": 9 * 10**5,
                              "kv_bytes": 10**5, "peak_gbps": 1.0, "weight_format": "bf16",
                              "kv_dtype": "bf16"}),
                  {"device": "h100", "code": {}}, "k")
    store.close()
    sources = [tables.rows_of("x.db", tmp_path)]
    assert tables.headline_row("engine", "h100-sxm5", sources).startswith(
        "| engine | H100 SXM | 5.00 (one run) | 60.0% | - | ")
    assert (tables.headline_row("engine-int4", "h100-sxm5", sources)
            == "| engine-int4 | H100 SXM | no steady run | | | |")
    assert (tables.headline_row("hf-eager", "h100-sxm5", sources)
            == "| hf-eager | H100 SXM | not measured | | | |")
