#!/usr/bin/env bash
# Why a fast GPU's step misses the floor, on the H200 as first run: bench/study.sh with the
# H200's folders (the rows into bench/results/h200-study/h200.db, the JSON files into
# bench/results/h200-explain/): the card's probe, where each millisecond goes for hf-eager and
# hf-static+graphs at ctx 2048, and the CUDA Graphs A/B (hf-static vs hf-static+graphs, N=10
# fresh sessions) at ctx 2048 and 16384.
#   bash bench/h200_explain.sh [explain|ab2048|ab16384|all]
set -euo pipefail
cd "$(dirname "$0")/.."
export GPU=h200 R=bench/results/h200-explain DB=bench/results/h200-study/h200.db
export EXPLAIN_PATHS="hf-eager hf-static+graphs"
case ${1:-all} in
  explain) bash bench/study.sh probe explain ;;
  ab2048 | ab16384) bash bench/study.sh "$1" ;;
  all) bash bench/study.sh probe explain ab2048 ab16384 ;;
  *) echo "h200_explain.sh: unknown stage '$1'" >&2; exit 2 ;;
esac
