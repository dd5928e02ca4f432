#!/usr/bin/env bash
# Why a fast GPU's step misses the floor, measured on this GPU into the study's results database
# (bench/results/h200-study/h200.db; the JSON files into bench/results/h200-explain/): the card's
# probe, where each millisecond goes for hf-eager and hf-static+graphs at ctx 2048, and the CUDA
# Graphs A/B (hf-static vs hf-static+graphs, N=10 fresh sessions) at ctx 2048 and 16384.
#   bash bench/h200_explain.sh [explain|ab2048|ab16384|all]
set -euo pipefail
cd "$(dirname "$0")/.."
DB=${DB:-bench/results/h200-study/h200.db}  # the study's database
R=bench/results/h200-explain  # the JSON files
mkdir -p "$R"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-}"  # names the runs it makes
fl() { python3 -m floorline "$@"; }
stage=${1:-all}
if [[ $stage == explain || $stage == all ]]; then
  fl probe --db "$DB" --model qwen2.5-7b --json > "$R/h200_probe.json"
  for path in hf-eager hf-static+graphs; do
    fl explain --db "$DB" --model qwen2.5-7b --ctx 2048 --path $path --json > "$R/h200_explain_${path//+/_}.json"
  done
fi
for ctx in 2048 16384; do
  if [[ $stage == ab$ctx || $stage == all ]]; then
    fl ab --db "$DB" --a hf-static --b hf-static+graphs --model qwen2.5-7b --ctx $ctx \
      --sessions 10 --seed 2026 --json > "$R/h200_ab_$ctx.json"
    python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['sentence'])" "$R/h200_ab_$ctx.json"
  fi
done
# one self-contained file to commit: the write-ahead log folded in and removed (unless another
# process has the database open)
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$DB" 2>/dev/null || true
fl show --db "$DB"
