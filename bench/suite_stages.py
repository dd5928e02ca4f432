"""The test suite in named stages, each ending in its own verdict line that names every failing
test and every test that had not finished, even when the stage is cut off.

    python3 bench/suite_stages.py [STAGE ...] [--logs DIR] [--workers N] [--test-timeout S]
                                  [--stage-limit S]

Stages (every test file is in exactly one; `rest` takes the files no other stage names):
    kernels        the Triton kernels against their references
    engine         the engine's step, formats, families, generation and quality
    measurement    cells, runs in child processes, steadiness, A/B, explain, energy, fleets
    trained-model  the trained model from its wheel (FLOORLINE_TEST_WHEEL where there is no
                   package index), speculation on it and the OpenAI-compatible server
    rest           the command line, storage, report, forecast and the rest

Each stage is one pytest run (pytest-xdist, a file to a worker at a time) whose log prints each
test's outcome with its node id as the test ends (`-v`); a test that runs past --test-timeout
fails with its stack (pytest-timeout); a stage still running at --stage-limit is interrupted
(SIGINT to its process group, then SIGKILL). Each test's start and outcome go to a journal as
they happen (bench/suite_journal.py), and the verdict is read from that journal, so it holds
whatever became of the run:

    suite kernels: PASS 212 passed, 3 skipped (95 s)
    suite engine: FAIL 1 failed, 1 unfinished, 120 passed (480 s, cut off at the stage's limit)
      failed      tests/test_engine.py::test_x
      unfinished  tests/test_engine.py::test_y

DIR gets STAGE.log (pytest's output), STAGE.journal (JSON lines) and STAGE.failures (each
failure's report, for a run cut off before pytest printed them). Exits 1 where a stage fails.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

STAGES = {
    "kernels": ["test_engine_kernels.py", "test_engine_kvfp8.py", "test_engine_quant.py",
                "test_engine_int4_groups.py", "test_layouts.py", "test_verify.py"],
    "engine": ["test_engine.py", "test_engine_cpu.py", "test_engine_families.py",
               "test_generate.py", "test_quality.py", "test_gguf.py", "test_gguf_blocks.py"],
    "measurement": ["test_runner.py", "test_sweep.py", "test_steady.py", "test_steadiness.py",
                    "test_cpu_steadiness.py", "test_ab.py", "test_explain_probe.py",
                    "test_energy.py", "test_provenance.py", "test_fleet.py",
                    "test_fleet_faults.py", "test_paths.py", "test_quantised.py"],
    "trained-model": ["test_real_model.py", "test_serve.py", "test_speculate.py",
                      "test_speculation_store.py"],
    "rest": None,
}


NOT_RUN_SHOWN = 10  # of the tests a stage cut off never started


def stage_files(tests: Path = TESTS) -> dict[str, list[Path]]:
    """Each stage's test files; a file a stage names that is not there is an error, so that a
    renamed file is never silently run by no stage."""
    every = sorted(p.name for p in tests.glob("test_*.py"))
    named = {f for files in STAGES.values() if files for f in files}
    missing = sorted(named - set(every))
    if missing:
        raise SystemExit(f"suite_stages: {', '.join(missing)} named by a stage but not in {tests}")
    return {stage: [tests / f for f in (files if files is not None
                                        else [f for f in every if f not in named])]
            for stage, files in STAGES.items()}


def read_journal(journal: Path) -> list[dict]:
    """The journal's events, in the order they came (none where pytest never started)."""
    events = []
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            events.append(json.loads(line))
        except ValueError:  # the last line of a run killed mid-write
            continue
    return events


def outcomes(events: list[dict]) -> dict[str, list[str]]:
    """Node ids by outcome (passed, failed, error, skipped, unfinished, not run) from a
    journal's events: a test failing in its call failed, in its setup or teardown is an error
    (as pytest counts them), a test started and never finished is unfinished, one collected and
    never started was not run, and a file that could not be collected is an error under its own
    path."""
    started, finished, status, collected = [], set(), {}, {}
    for e in events:
        node = e["nodeid"]
        if e["event"] == "collected":
            collected.update(dict.fromkeys(e["ids"]))
        elif e["event"] == "start":
            started.append(node)
        elif e["event"] == "finish":
            finished.add(node)
        elif e["event"] == "collect":
            status[node] = "error"
        elif e["outcome"] == "failed":
            status[node] = "failed" if e["when"] in ("call", "???") else "error"
        elif e["outcome"] == "skipped" and status.get(node) not in ("failed", "error"):
            status[node] = "skipped"
        elif e["when"] == "call" and node not in status:
            status[node] = "passed"
    for node in started:  # a passed test whose teardown never ended is unfinished too
        if node not in finished and status.get(node, "passed") == "passed":
            status[node] = "unfinished"
    by = {k: [] for k in ("failed", "error", "unfinished", "passed", "skipped", "not run")}
    for node, s in status.items():
        by[s].append(node)
    by["not run"] = [node for node in collected if node not in status]
    return by


def verdict(stage: str, by: dict[str, list[str]], seconds: float, returncode: int,
            cut_off: bool) -> tuple[bool, list[str]]:
    counts = ", ".join(f"{len(by[k])} {k}" for k in by if by[k]) or "no tests ran"
    note = f"{seconds:.0f} s" + (", cut off at the stage's limit" if cut_off else "")
    named = [f"  {k:<10}  {node}" for k in ("failed", "error", "unfinished") for node in by[k]]
    if by["not run"]:  # named in full in the journal
        shown = by["not run"][:NOT_RUN_SHOWN]
        more = len(by["not run"]) - len(shown)
        named += [f"  {'not run':<10}  {node}" for node in shown]
        if more:
            named.append(f"  ... and {more} more not run")
    passed = returncode in (0, 5) and not named and not cut_off  # 5: every test deselected
    if not passed and not named:
        named = [f"  pytest ended with code {returncode} and named no failing test: see its log"]
    return passed, [f"suite {stage}: {'PASS' if passed else 'FAIL'} {counts} ({note})", *named]


def run_stage(stage: str, files: list[Path], logs: Path, workers: int, test_timeout: float,
              limit: float, grace: float = 30) -> tuple[bool, list[str]]:
    """One stage's pytest run and its verdict; cut off at `limit` seconds, it gets SIGINT and
    `grace` seconds to end before SIGKILL."""
    log, journal = logs / f"{stage}.log", logs / f"{stage}.journal"
    journal.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
               "-p", "suite_journal",
               "--continue-on-collection-errors", f"--timeout={test_timeout:g}",
               *([f"-n{workers}", "--dist", "loadfile"] if workers > 1 else []),
               *map(str, files)]
    here = str(Path(__file__).parent)  # the journal's plugin, for pytest and its workers
    # (a pytest run from inside another's worker would take itself for a worker: no journal)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_XDIST_") and k != "PYTEST_CURRENT_TEST"}
    env.update(FLOORLINE_TEST_JOURNAL=str(journal), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        cut_off = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            cut_off = True
            # SIGINT first: pytest prints what it has (failures with their stacks) and ends
            for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
    events = read_journal(journal)
    write_failures(events, logs / f"{stage}.failures")
    return verdict(stage, outcomes(events), time.monotonic() - start, proc.returncode, cut_off)


def write_failures(events: list[dict], into: Path) -> None:
    """Each failing report's text, in the order they came."""
    into.write_text("".join(f"== {e['nodeid']} ({e.get('when', 'collection')})\n{e['detail']}\n"
                            for e in events if e.get("detail")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", metavar="STAGE",
                        help=f"stages to run, in order (default all: {', '.join(STAGES)})")
    parser.add_argument("--logs", type=Path, default=Path("suite-logs"),
                        help="folder for each stage's log, journal and failures")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--test-timeout", type=float, default=300,
                        help="seconds a test may run before it fails with its stack")
    parser.add_argument("--stage-limit", type=float, default=480,
                        help="seconds a stage may run before it is cut off")
    args = parser.parse_args()
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        print(f"suite_stages: no stage {', '.join(unknown)} (stages: {', '.join(STAGES)})",
              file=sys.stderr)
        return 2
    files = stage_files()
    args.logs.mkdir(parents=True, exist_ok=True)
    ok = True
    for stage in args.stages or STAGES:
        passed, lines = run_stage(stage, files[stage], args.logs, args.workers,
                                  args.test_timeout, args.stage_limit)
        print("\n".join(lines), flush=True)
        ok &= passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
