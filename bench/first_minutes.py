"""How long the commands that only calculate take, as a fresh clone's user first runs them: each
in a fresh process, wall clock and CPU time (the median of --runs), refusals and every --help
included. CPU time is the steadier figure on a shared host. The processes inherit the
environment: with PYTHONDONTWRITEBYTECODE set, every run compiles floorline's modules again.

    python bench/first_minutes.py > bench/results/first-minutes/first_minutes_after.txt
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import typer

from floorline.cli import app

MODEL, GPU = "qwen2.5-7b", "h200"
COMMANDS = [
    ("floor", ["floor", "--model", MODEL, "--gpu", GPU]),
    ("models", ["models"]),
    ("gpus", ["gpus"]),
    ("formats", ["formats"]),
    ("paths", ["paths"]),
    ("predict", ["predict", "--model", MODEL, "--gpu", GPU, "--path", "hf-static"]),
    ("floor, an instruct id", ["floor", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", GPU]),
    ("refused: unknown GPU", ["floor", "--model", MODEL, "--gpu", "h300"]),
    ("refused: unknown model", ["floor", "--model", "qwen9-7b", "--gpu", GPU]),
    ("refused: predict, unknown GPU", ["predict", "--model", MODEL, "--gpu", "h300", "--path",
                                       "hf-static"]),
    ("refused: ab, unknown path", ["ab", "--a", "hf-static", "--b", "hf-turbo"]),
    ("refused: ab, path not runnable", ["ab", "--a", "hf-static", "--b", "hf-static+graphs",
                                        "--device", "cpu"]),
]


def help_commands() -> list[tuple[str, list[str]]]:
    """`--help` of floorline and of every command and subcommand."""
    def walk(command, words):
        yield " ".join(words + ["--help"]), [*words[1:], "--help"]
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            yield from walk(sub, words + [name])

    return list(walk(typer.main.get_command(app), ["floorline"]))


def timed(argv: list[str], cwd: str) -> tuple[float, float, int]:
    """Wall and CPU seconds (the child's user + system) of `floorline ARGV`, and its exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "floorline", *argv], cwd=cwd,
                          capture_output=True, env={**os.environ, "COLUMNS": "200"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-help", action="store_true", help="Leave out the --help lines.")
    args = parser.parse_args()
    commands = COMMANDS + ([] if args.no_help else help_commands())
    width = max(len(label) for label, _ in commands)
    bytecode = "compiled each run" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "cached"
    print(f"{'command':<{width}}  wall s  CPU s  exit   (median of {args.runs}, fresh processes, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, bytecode {bytecode})")
    with tempfile.TemporaryDirectory() as cwd:  # no floorline.db of the user's is read
        for label, argv in commands:
            runs = [timed(argv, cwd) for _ in range(args.runs)]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(f"{label:<{width}}  {wall:6.2f}  {cpu:5.2f}  {runs[-1][2]:4d}", flush=True)


if __name__ == "__main__":
    main()
