#!/usr/bin/env bash
# The study's bf16 grid on this GPU (3 models x 4 contexts, hf-eager) plus the static-cache paths
# for qwen2.5-7b at ctx 2048 and 16384, into one results database. Resumable: a cell already
# valid under the same environment is skipped, so the stages can run in separate calls.
#   bash bench/h200_study.sh [static|eager|compile|all]
set -euo pipefail
cd "$(dirname "$0")/.."
DB=${DB:-bench/results/h200-study/h200.db}
mkdir -p "$(dirname "$DB")"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-}"  # names the runs it makes
fl() { python3 -m floorline "$@"; }
stage=${1:-all}
if [[ $stage == static || $stage == all ]]; then
  fl sweep --db "$DB" --models qwen2.5-7b --ctx 2048,16384 --paths hf-static,hf-static+graphs
fi
if [[ $stage == eager || $stage == all ]]; then
  fl sweep --db "$DB"   # bare: the study's grid
fi
if [[ $stage == compile || $stage == all ]]; then
  fl sweep --db "$DB" --models qwen2.5-7b --ctx 2048,16384 --paths hf-static+compile+graphs
fi
# one self-contained file to commit: the write-ahead log folded in and removed (unless another
# process has the database open)
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$DB" 2>/dev/null || true
fl show --db "$DB" --json > "${DB%.db}_cells.json"
fl show --db "$DB" --csv > "${DB%.db}_cells.csv"
fl show --db "$DB"
