#!/usr/bin/env bash
# A GPU's report from its committed results (no GPU needed): its databases merged into
# bench/results/merged/${GPU}_all.db, one report in docs/report-$GPU/ with a screenshot of its
# first screen in headless Chromium (where there is one), and the README's headline figure of
# that GPU, docs/figures/headline-$GPU.png (the runs bench/quote_tables.py quotes).
#   bash bench/report.sh h200|h100
# The H200's databases are those measured under the default protocol (64 timed steps after the
# warm-up: 8 steps before the automatic warm-up existed, until steady since; random weights from
# the real configs); left out: h200_checkpoint.db, a smoke test that a checkpoint directory
# loads (a tiny Qwen2 of 0.6 MB of weights, ctx 128), not a measurement of a real model. The
# H100's are every database in its folders (bench/results/h100-*/).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
R=bench/results
GPU=${1:?"bash bench/report.sh h200|h100"}
case $GPU in
  h200) CATALOGUE=h200
    DBS=($R/h200-study/h200.db $R/h200-study/h200_eager_repeat.db
         $R/h200-engine/h200_engine.db $R/h200-engine-quant/h200_engine_quant.db
         $R/h200-engine-retimed/h200_engine_quant_retimed.db $R/h200-engine-longctx/h200_engine_longctx.db
         $R/h200-engine-kvfp8/h200_engine_kvfp8.db $R/h200-quantised/h200_quantised.db
         $R/h200-engine-families/h200_engine_families.db $R/h200-engine-tokens/h200_engine_tokens.db
         $R/h200-engine-energy/h200_engine_energy.db $R/h200-engine-runs/h200_engine_runs.db) ;;
  h100) CATALOGUE=h100-sxm5 DBS=($R/h100-*/*.db) ;;
  *) echo "report.sh: no databases listed for '$GPU' (h200, h100)" >&2; exit 2 ;;
esac
ALL=$R/merged/${GPU}_all.db OUT=docs/report-$GPU
mkdir -p $R/merged
rm -f $ALL $ALL-wal $ALL-shm
$PY -m floorline merge $ALL "${DBS[@]}"
# One self-contained file to commit: no write-ahead log beside it.
$PY -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute("PRAGMA journal_mode=DELETE")' $ALL
rm -rf $OUT
$PY -m floorline report --db $ALL --out $OUT
if command -v chromium > /dev/null; then
  chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --window-size=1200,900 \
    --screenshot=$OUT/first-screen.png "file://$PWD/$OUT/index.html"
else
  echo "report.sh: no chromium here, so no $OUT/first-screen.png" >&2
fi
# The README's headline figure: the runs its table quotes (bench/quote_tables.py: each path from
# the first of the GPU's databases with a steady run of it), drawn as the report draws its first
# figure.
mkdir -p docs/figures
$PY - "$CATALOGUE" "docs/figures/headline-$GPU.png" <<'PY'
import sys

sys.path.insert(0, "bench")
from quote_tables import HEADLINE, HEADLINE_PATHS, HEADLINE_SOURCES, RESULTS, rows_of

from floorline.report.figures import png
from floorline.report.headline import headline, quoted

gpu, out = sys.argv[1:]
sources = [[r for r in rows_of(name, RESULTS)[0] if r.gpu == gpu]
           for name in HEADLINE_SOURCES[gpu]]
fig, _, _ = headline(quoted(sources, *HEADLINE, HEADLINE_PATHS))
open(out, "wb").write(png(fig))
PY
grep -A2 "^## Forecast accuracy" $OUT/report.md || true
grep -A5 "^## Forecast of the study" $OUT/report.md || true
