"""How long a job's fresh process takes to start, as a sweep's cell pays it: from the runner's
call to the moment the job's function runs with torch imported (what every cell imports
first), and the whole round trip of an empty job. Run from the repository's root (the children
import this file as `bench.child_startup`):

    python bench/child_startup.py --runs 7            # each job a new interpreter
    python bench/child_startup.py --runs 7 --warm     # each job forked from the warm worker

With --warm, a first job starts the worker (once per sweep); it is reported apart.
"""

import argparse
import contextlib
import statistics
import time

from floorline.measure import runner


def started() -> dict:
    """The job: when it began, torch imported."""
    import torch  # noqa: F401

    return {"at": time.time()}


def timed() -> tuple[float, float]:
    """One job's start-up and round trip, in seconds."""
    t0 = time.time()
    at = runner.run_in_child("bench.child_startup:started", {})["at"]
    return at - t0, time.time() - t0


def report(name: str, values: list[float]) -> None:
    print(f"{name}: median {statistics.median(values):.3f} s, range {min(values):.3f}-"
          f"{max(values):.3f} s, N={len(values)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warm", action="store_true", help="fork jobs from a warm worker")
    args = parser.parse_args()
    mode = "warm" if args.warm else "fresh"
    with runner.warm_worker() if args.warm else contextlib.nullcontext():
        if args.warm:
            report("warm: first job, starting the worker", [timed()[0]])
        starts, trips = zip(*[timed() for _ in range(args.runs)])
    report(f"{mode}: start-up", starts)
    report(f"{mode}: round trip", trips)


if __name__ == "__main__":
    main()
