#!/usr/bin/env bash
# The H200 report from the committed results (no GPU needed): every database measured under the
# default protocol (64 timed steps after the warm-up: 8 steps before the automatic warm-up
# existed, until steady since; random weights from the real configs)
# merged into bench/results/merged/h200_all.db, then one report in docs/report-h200/ with a screenshot
# of its first screen in headless Chromium; and the README's headline figure,
# docs/figures/headline-h200.png.
# Left out: h200_checkpoint.db, a smoke test that a checkpoint directory loads (a tiny Qwen2 of
# 0.6 MB of weights in a temporary folder, ctx 128), not a measurement of a real model.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
R=bench/results
ALL=$R/merged/h200_all.db
mkdir -p $R/merged
rm -f $ALL $ALL-wal $ALL-shm
$PY -m floorline merge $ALL $R/h200-study/h200.db $R/h200-study/h200_eager_repeat.db \
  $R/h200-engine/h200_engine.db $R/h200-engine-quant/h200_engine_quant.db \
  $R/h200-engine-retimed/h200_engine_quant_retimed.db $R/h200-engine-longctx/h200_engine_longctx.db \
  $R/h200-engine-kvfp8/h200_engine_kvfp8.db $R/h200-quantised/h200_quantised.db \
  $R/h200-engine-families/h200_engine_families.db $R/h200-engine-tokens/h200_engine_tokens.db \
  $R/h200-engine-energy/h200_engine_energy.db $R/h200-engine-runs/h200_engine_runs.db
# One self-contained file to commit: no write-ahead log beside it.
$PY -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute("PRAGMA journal_mode=DELETE")' $ALL
rm -rf docs/report-h200
$PY -m floorline report --db $ALL --out docs/report-h200
chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --disable-sync --no-first-run --window-size=1200,900 \
  --screenshot=docs/report-h200/first-screen.png "file://$PWD/docs/report-h200/index.html"
# The README's headline figure: the runs its table quotes (bench/quote_tables.py: each path from
# the first database with a steady run of it), drawn as the report draws its first figure.
mkdir -p docs/figures
$PY - <<'EOF'
import sys

sys.path.insert(0, "bench")
from quote_tables import HEADLINE, HEADLINE_PATHS, HEADLINE_SOURCES, RESULTS, rows_of

from floorline.report.figures import png
from floorline.report.headline import headline, quoted

sources = [rows_of(name, RESULTS)[0] for name in HEADLINE_SOURCES["h200"]]
fig, _, _ = headline(quoted(sources, *HEADLINE, HEADLINE_PATHS))
open("docs/figures/headline-h200.png", "wb").write(png(fig))
EOF
grep -A2 "^## Forecast accuracy" docs/report-h200/report.md
grep -A5 "^## Forecast of the study" docs/report-h200/report.md
