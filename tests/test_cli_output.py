"""What the command line prints beyond its results: progress with the time left, each table
once, whole lines, and none of the libraries' noise a user did not ask for."""

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

from conftest import needs_bnb, run_cli


def test_sweep_prints_progress_to_stderr_and_its_table_once(tmp_path):
    proc = run_cli("sweep", "--db", tmp_path / "r.db", "--models", "tiny-llama", "--ctx", "8,16",
                   "--paths", "hf-eager", "--steps", "2", "--warmup", "0", "--gpu", "l4",
                   "--device", "cpu", check=True)
    assert proc.stdout.count("2 measured, 0 already valid") == 1
    assert proc.stdout.count("tiny-llama") == 2  # one row per cell, in one table
    # Not a terminal: no live redrawing, no colour codes, the bar's last state once.
    assert "\x1b[" not in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if "2/2" in line]
    assert len(progress) == 1 and re.search(r"\d+:\d\d:\d\d left \d+:\d\d:\d\d", progress[0])
    assert "Warning" not in proc.stderr


def test_the_demo_runs_the_sweep_and_the_report_without_show():
    script = (Path(__file__).parents[1] / "quickstart.sh").read_text()
    demo = script[script.index("  demo)"):]
    demo = demo[:demo.index(";;")]
    assert "sweep" in demo and "report" in demo and " show" not in demo


def test_hf_paths_use_the_cache_argument_transformers_asks_for():
    import torch

    from floorline.models import resolve_model
    from floorline.paths import open_session, parse_path

    for name in ("hf-eager", "hf-static"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = open_session(parse_path(name), resolve_model("tiny-llama"), "cpu", 64, 0)
            with torch.no_grad():
                session.prefill(16)
                session.step()
        assert not [w for w in caught if "past_key_values" in str(w.message)], name
        # The cache was passed (not dropped into **kwargs): it holds the prompt and the step.
        assert int(session.cache.get_seq_length()) == 17, name
        session.close()


def test_explain_prints_no_profiler_lines(tmp_path):
    proc = run_cli("explain", "--model", "tiny-llama", "--ctx", "16", "--path", "hf-eager",
                   "--steps", "2", "--warmup", "1", "--device", "cpu", "--gpu", "l4",
                   "--db", tmp_path / "r.db")
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


@needs_bnb
def test_bitsandbytes_on_the_cpu_prints_nothing_on_import():
    proc = subprocess.run([sys.executable, "-c", "import floorline.paths, bitsandbytes"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "kernels-community" not in proc.stderr, proc.stderr


def test_an_instruct_id_says_in_one_line_which_shipped_config_stands_in():
    proc = run_cli("floor", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "h200", "--ctx",
                   "2048", "--json", check=True)
    assert [f["model"] for f in json.loads(proc.stdout)] == ["qwen2.5-7b"]
    assert proc.stderr == ("note: the shipped config qwen2.5-7b stands in for "
                           "Qwen/Qwen2.5-7B-Instruct (the same architecture and shapes)\n")
