"""A/B experiments a results database holds without a summary (cut off before their last
session), summarised over the sessions they stored as `floorline ab` summarises a whole one:
the mean ratio with its 95% BCa interval, each session's ratio, and the range of every timed
step of each arm. `floorline ab --resume` finishes such an experiment; this says what it holds
meanwhile.

    PYTHONPATH=src python bench/ab_sessions.py DB
"""

import json
import sqlite3
import sys

from floorline.measure.ab import Plan, stored_session, summarise_sessions


def main(db: str) -> None:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    for experiment, text in con.execute(
            "SELECT id, plan FROM ab_experiments WHERE summary IS NULL ORDER BY id"):
        plan = Plan(**{k: v for k, v in json.loads(text).items() if k != "paired"})
        names = ["idx", "status", "reason", "first_arm", "samples_a", "samples_b", "details"]
        rows = [dict(zip(names, r)) for r in con.execute(
            f"SELECT {', '.join(names)} FROM ab_sessions WHERE experiment_id=? ORDER BY idx",
            (experiment,))]
        for r in rows:
            for k in ("samples_a", "samples_b", "details"):
                r[k] = None if r[k] is None else json.loads(r[k])
        summary = summarise_sessions(plan, [stored_session(r) for r in rows])
        print(f"experiment {experiment}, cut off after {len(rows)} of {plan.sessions} sessions: "
              f"{summary.sentence()}")
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
