#!/usr/bin/env bash
# The study's bf16 grid on the H200 as first run (bench/results/h200-study/): bench/study.sh with
# the H200's folder, hf-eager over the grid and the static-cache paths for qwen2.5-7b at ctx 2048
# and 16384 only. Resumable, as bench/study.sh is.
#   bash bench/h200_study.sh [static|eager|compile|all]
set -euo pipefail
cd "$(dirname "$0")/.."
export GPU=h200 R=bench/results/h200-study
qwen() { MODELS=qwen2.5-7b CTX=2048,16384 bash bench/study.sh "$@"; }
case ${1:-all} in
  static | compile) qwen "$1" ;;
  eager) bash bench/study.sh eager ;;
  all) qwen static && bash bench/study.sh eager && qwen compile ;;
  *) echo "h200_study.sh: unknown stage '$1'" >&2; exit 2 ;;
esac
