"""A/B experiments a results database holds without a summary (cut off before their last
session), summarised over the sessions they stored as `floorline ab` summarises a whole one:
the mean ratio with its 95% BCa interval, each session's ratio, and the range of every timed
step of each arm. `floorline ab --resume` finishes such an experiment; this says what it holds
meanwhile.

    PYTHONPATH=src python bench/ab_sessions.py DB
"""

import sys
from pathlib import Path

from floorline.measure.ab import Plan, stored_session, summarise_sessions
from floorline.store import Store


def main(db: str) -> None:
    store = Store(Path(db), read_only=True)
    for experiment in reversed(store.unfinished_abs()):  # oldest first
        plan = Plan(**{k: v for k, v in experiment["plan"].items() if k != "paired"})
        rows = experiment["sessions"]
        summary = summarise_sessions(plan, [stored_session(r) for r in rows])
        print(f"experiment {experiment['id']}, cut off after {len(rows)} of {plan.sessions} "
              f"sessions: {summary.sentence()}")
        ok = summary.ok
        print("  session ratios: " + ", ".join(f"{s.ratio:.3f}" for s in ok))
        for arm, medians, steps in ((plan.a, [s.ms_a for s in ok],
                                     [x for s in ok for x in s.samples_a]),
                                    (plan.b, [s.ms_b for s in ok],
                                     [x for s in ok for x in s.samples_b])):
            print(f"  {arm}: session medians {min(medians):.2f}-{max(medians):.2f} ms; "
                  f"its {len(steps)} timed steps {min(steps):.2f}-{max(steps):.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
