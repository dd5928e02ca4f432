"""The commands that only calculate, their refusals and every --help answer without loading the
heavy libraries, which take seconds on a fresh machine: each runs in a fresh interpreter that
then says what it imported. Unlike a timing (bench/first_minutes.py), this holds under any load."""

import json
import subprocess
import sys

import pytest
import typer

from floorline.cli import app

HEAVY = ("torch", "transformers", "triton", "pandas", "matplotlib", "dask", "distributed",
         "scipy")

# Runs `floorline ARGV` for each ARGV of the JSON list it is given, then prints the exit codes
# and the heavy libraries imported as its last line.
RUN = f"""
import json, sys
from floorline.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["floorline", *argv]
    try:
        main()
    except SystemExit as e:
        codes.append(e.code or 0)
print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def run(argvs: list[list[str]], cwd) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(argvs)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv, code", [
    (["floor", "--model", "qwen2.5-7b", "--gpu", "h200"], 0),
    (["floor", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "h200", "--json"], 0),
    (["models"], 0),
    (["gpus"], 0),
    (["formats"], 0),
    (["predict", "--model", "llama-3.1-8b", "--gpu", "l4", "--path", "engine"], 0),
    (["floor", "--model", "qwen2.5-7b", "--gpu", "h300"], 2),
    (["floor", "--model", "qwen9", "--gpu", "h200"], 2),
    (["predict", "--model", "qwen2.5-7b", "--gpu", "h300", "--path", "engine"], 2),
    (["ab", "--a", "hf-static", "--b", "hf-turbo"], 2),
    (["ab", "--a", "hf-static", "--b", "hf-static", "--model", "qwen9", "--gpu", "l4"], 2),
    (["ab", "--a", "hf-static", "--b", "hf-static+graphs", "--device", "cpu"], 2),
])
def test_a_command_that_only_calculates_loads_no_heavy_library(tmp_path, argv, code):
    assert run([argv], tmp_path) == {"codes": [code], "heavy": []}


def test_paths_loads_no_heavy_library():
    assert run([["paths", "--device", "cpu"]], None) == {"codes": [0], "heavy": []}


def test_every_help_loads_no_heavy_library():
    def helps(command, words):
        yield [*words, "--help"]
        for name, sub in getattr(command, "commands", {}).items():
            yield from helps(sub, [*words, name])

    argvs = list(helps(typer.main.get_command(app), []))
    assert len(argvs) > 15
    assert run(argvs, None) == {"codes": [0] * len(argvs), "heavy": []}
