#!/usr/bin/env bash
# The example reports from the committed H200 results (no GPU needed): docs/h200-report/ and
# docs/h200-quantised-report/ (issue 4's cells), the first with the
# forecast's leave-one-out table and its check against the study's published cells, and a
# screenshot of the first screen in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
python3 -m floorline report --db bench/results/h200.db --out docs/h200-report
python3 -m floorline report --db bench/results/h200_quantised.db --out docs/h200-quantised-report
chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --disable-sync --no-first-run --window-size=1200,900 \
  --screenshot=docs/h200-report/screenshot.png "file://$PWD/docs/h200-report/index.html"
grep -A2 "^## Forecast accuracy" docs/h200-report/report.md
grep -A5 "^## Forecast of the study" docs/h200-report/report.md
