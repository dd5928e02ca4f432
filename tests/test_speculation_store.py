"""Speculative decoding measured into the results database: per model, path, drafter and
workload, each figure against independent arithmetic on what was stored."""

import pytest

from conftest import run_here
from floorline.errors import FloorlineError
from floorline.hardware import lookup
from floorline.measure.speculation import speculation_key
from floorline.measure.sweep import Sweep
from floorline.models import resolve_model
from floorline.records import INVALID, VALID
from floorline.store import Store, merge
from floorline.traffic import floor


def test_random_weights_are_an_invalid_row_with_the_reason(tmp_path):
    runner = Sweep(Store(tmp_path / "s.db"), "cpu", lookup("h200"))
    result = runner.run_speculation(speculation_key("tiny-llama", "engine", "lookup", "json"))
    assert result.status == INVALID and "random weights" in result.reason
    (row,) = runner.store.speculation_rows()
    assert row.status == INVALID and row.tokens is None


@pytest.mark.parametrize("args, message", [
    (("engine", "lookup", "poems"), "unknown workload 'poems'"),
    (("hf-eager", "lookup", "edit"), "the engine's own paths"),
    (("engine+graphs", "lookup", "edit"), "the engine's own paths"),
    (("engine", "lookup", "edit", 16), "must be 1 to 15"),
    (("engine", "lookup", "edit", 4, 1), "--max-new-tokens must be at least 2"),
])
def test_a_bad_key_is_one_line(args, message):
    with pytest.raises(FloorlineError, match=message):
        speculation_key("tiny-llama", *args)


def test_a_workload_is_measured_into_the_database_skipped_when_held_shown_and_reported(
        smollm2, tmp_path):
    gpu = lookup("h200")
    db = tmp_path / "s.db"
    command = ("speculate", "--model", smollm2.weights_dir, "--workloads", "edit",
               "--draft-tokens", "4", "--max-new-tokens", "6", "--device", "cpu", "--gpu",
               gpu.name, "--db", db)
    assert "1 measured, 0 already valid" in run_here(*command, check=True).stdout
    (row,) = Store(db, read_only=True).speculation_rows()
    assert (row.workload, row.status, row.identical) == ("edit", VALID, 4), row.reason
    (run,) = Store(db, read_only=True).runs()
    assert run["command"] == "speculate" and run["rows"]["speculation"] == 1
    replies = row.details["replies"]
    assert row.prompts == len(replies) == 4
    assert row.tokens == sum(r["tokens"] for r in replies)
    steps = sum(r["steps"] for r in replies)
    assert row.verify_steps + row.plain_steps == steps
    # a step gives its kept drafts and its own token, less any past the reply's end
    assert 0 < row.tokens <= row.accepted + steps
    assert row.tokens_per_step == pytest.approx(row.tokens / steps)
    assert row.acceptance == pytest.approx(row.accepted / row.drafted)
    spec_ms = sum(r["decode_ms"] for r in replies)
    assert row.ms_per_token == pytest.approx(spec_ms / row.tokens)
    assert row.step_ms == pytest.approx(spec_ms / steps)
    plain_ms = sum(r["plain_decode_ms"] for r in replies)
    assert row.plain_ms_per_token == pytest.approx(plain_ms / row.tokens)  # same replies
    assert row.speedup == pytest.approx(row.plain_ms_per_token / row.ms_per_token)
    # the steps read from each prompt's end to its reply's: their mean, weighted by steps
    mean = sum(r["steps"] * (2 * r["prompt_tokens"] + r["tokens"] - 1) / 2
               for r in replies) / steps
    assert row.mean_ctx == pytest.approx(mean)
    step_floor = floor(resolve_model(str(smollm2.weights_dir)), gpu, round(mean), "fp32",
                       "fp32").floor_ms
    assert row.floor_ms == pytest.approx(step_floor)
    assert row.floor_ms_per_token == pytest.approx(step_floor * steps / row.tokens)
    # held valid: skipped; merged once
    assert "0 measured, 1 already valid" in run_here(*command, check=True).stdout
    merged = Store(tmp_path / "m.db")
    assert merge(merged, [db])[str(db)]["speculation"] == 1
    assert merge(merged, [db])[str(db)]["speculation"] == 0
    shown = run_here("show", "--db", db, check=True).stdout
    assert "speculative decoding" in shown and "edit" in shown
    report = run_here("report", "--db", db, "--out", tmp_path / "r", check=True)
    assert "figure 11" not in report.stderr  # the speculation figure is drawn
    md = (tmp_path / "r" / "report.md").read_text()
    table = md[md.index("## Speculative decoding"):].split("\n\n")[1].splitlines()
    assert len(table) == 2 + 1 and "lookup" in table[2]


@pytest.mark.parametrize("args, message", [
    (("--workloads", "poems"), "unknown workload 'poems'"),
    (("--paths", "hf-eager"), "the engine's own paths"),
    (("--draft-tokens", "16"), "must be 1 to 15"),
    (("--dtype", "float16"), "--dtype must be bfloat16 or float32"),
    (("--draft", "no-such-model"), "no-such-model"),
    (("--draft", "tiny-qwen2"), "draft model tiny-qwen2 has no trained weights"),
    (("--gpu", "no-such-gpu"), "no-such-gpu"),
])
def test_the_speculate_command_refuses_in_one_line(tmp_path, args, message):
    proc = run_here("speculate", "--model", "tiny-llama", *args, "--device", "cpu", "--db",
               tmp_path / "s.db")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "s.db").exists()


def test_merge_refuses_a_valid_speculation_row_without_its_figures(tmp_path):
    import sqlite3

    from floorline.records import SpeculationResult

    source = Store(tmp_path / "s.db")
    key = speculation_key("tiny-llama", "engine", "lookup", "edit")
    source.add_speculation(SpeculationResult(key, "h200", VALID), {"device": "cpu"}, "env")
    source.close()
    target = tmp_path / "t.db"
    with pytest.raises(FloorlineError, match="speculation row 1: valid with tokens None"):
        merge(Store(target), [tmp_path / "s.db"])
    assert not target.exists()  # nothing was merged
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("UPDATE speculation SET status='invalid', reason='a test'")
    assert merge(Store(target), [tmp_path / "s.db"])[str(tmp_path / "s.db")]["speculation"] == 1
