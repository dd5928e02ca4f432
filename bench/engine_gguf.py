"""GGUF blocks as stored on this machine's GPU: the engine's `engine-gguf` cells beside its own
int4 (`engine-int4`) and 16-bit (`engine`) in one sweep, each against the floor of its own bytes.

For each model and format a directory is written once (config.json and a GGUF of random blocks,
as llama-quantize lays the file out, its LM head in Q8_0 so that the engine runs it as stored),
then one sweep measures every directory's cells, and a line per cell prints its step, its
fraction of the floor and its weight format. The trained SmolLM2-135M runs from its own file
where it has been fetched.

    python bench/engine_gguf.py --dirs /tmp/gguf-models --db gguf.db \
        [--models qwen2.5-7b] [--formats q4_0,q4_1,q8_0] [--ctx 2048] [--trained]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from floorline.records import VALID
from floorline.store import Store


def model_dir(root: Path, model: str, fmt: str) -> Path:
    """The directory of `model`'s config and a random `fmt` GGUF, written once."""
    from floorline.layouts.gguf import write_random_gguf
    from floorline.models import resolve_model

    directory = root / f"{model}-{fmt}"
    gguf = directory / f"{model}-{fmt}.gguf"
    if not gguf.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        config = resolve_model(model).config
        config.save_pretrained(directory)
        partial = gguf.with_suffix(".partial")
        write_random_gguf(config, partial, fmt, seed=0, head="q8_0")
        partial.rename(gguf)
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dirs", type=Path, required=True, help="where the models are written")
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--models", default="qwen2.5-7b")
    parser.add_argument("--formats", default="q4_0,q4_1,q8_0")
    parser.add_argument("--ctx", default="2048")
    parser.add_argument("--trained", action="store_true",
                        help="also the fetched smollm2-135m from its own file, at ctx 128")
    args = parser.parse_args()
    dirs = [model_dir(args.dirs, m, f) for m in args.models.split(",")
            for f in args.formats.split(",")]
    sweeps = [([str(d) for d in dirs], args.ctx)]
    if args.trained:
        sweeps.append((["smollm2-135m"], "128"))
    for models, ctx in sweeps:
        done = subprocess.run([sys.executable, "-m", "floorline", "sweep", "--models",
                               ",".join(models), "--ctx", ctx, "--paths",
                               "engine,engine-int4,engine-gguf", "--no-quality", "--db",
                               str(args.db)])
        if done.returncode != 0:
            print(f"engine_gguf: the sweep of {', '.join(models)} ended with "
                  f"{done.returncode}", file=sys.stderr)
            return 1
    store = Store(args.db, read_only=True)
    try:
        for row in store.rows():
            if row.status != VALID:
                print(f"{row.model} ctx {row.ctx} {row.path}: {row.status}: {row.reason}")
                continue
            print(f"{row.model} ctx {row.ctx} {row.path}: {row.median_ms:.3f} ms, "
                  f"{row.fraction_of_floor:.1%} of the floor of {row.weight_format} "
                  f"({row.total_bytes / 1e9:.3f} GB)")
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
