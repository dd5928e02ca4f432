#!/usr/bin/env bash
# The study's grid, its CUDA Graphs A/B and what the forecast needs, on this machine's GPU, into
# that GPU's results folder: bench/results/$GPU-study/ holds $GPU.db and the probe, explain and
# A/B files ($GPU names the folder and files; the cells name the GPU floorline detects).
# Resumable: a sweep skips cells already valid under the same environment, so a stage cut off
# by a call's time limit goes on where it stopped when called again. Stages run in the order
# given, then the database is folded into one file with its cells as JSON and CSV.
#   GPU=h100 bash bench/study.sh STAGE [STAGE ...]
# Minutes on one GPU, from the committed runs' times (an engine or graph-replayed cell about
# 25 s, an eager or static-cache one about 50 s, a torch.compile one about 140 s, each in a
# fresh process with its energy read):
#   probe        floorline probe: streaming read, launch and replay costs (under 1)
#   explain      where the step's time goes, Qwen2.5-7B ctx 2048, $EXPLAIN_PATHS (default
#                hf-eager and engine: the forecast's launches and small kernels; about 1 each)
#   headline     the headline's cells (Qwen2.5-7B ctx 2048, $HEADLINE_PATHS) in RUNS fresh
#                sweeps (default 1) with --force, labelled headline-N from N = FIRST (default
#                1): the README quotes each as the median over these runs (about 3.7 a run)
#   ab2048, ab16384   the CUDA Graphs A/B at Qwen2.5-7B: hf-static against hf-static+graphs,
#                10 fresh sessions, seed 2026 (about 4)
#   ab-engine    hf-static+graphs against the engine at ctx 2048, 10 fresh sessions of each
#                (unpaired: about 7)
#   small        models under 2 B parameters, launch-bound: $SMALL_MODELS on hf-static+graphs
#                and the engine at ctx 128 and 2048 (about 3)
#   eager        hf-eager over the study's grid, $MODELS x $CTX (about 10)
#   static       hf-static and hf-static+graphs over the grid (about 15: two calls, or one
#                per model with MODELS=...)
#   engine       engine, engine-int4 and engine-fp8 over the grid, engine-kvfp8 at 16384 (about
#                16: two calls)
#   compile      hf-static+compile+graphs over the grid (about 28: three calls)
# The study's quantised stock paths (bnb-nf4, AWQ with Marlin, GPTQ with ExLlamaV2, llama.cpp
# Q4_0) need libraries the GPU machine lacks, carried as wheels and built there:
# bench/h200_quantised.sh (setup, build-llamacpp, then hf, packed and llamacpp with
# DB=bench/results/$GPU-study/${GPU}_quantised.db).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=${GPU:?"name the GPU's results folder: GPU=h100 bash bench/study.sh STAGE"}
STAGES="probe explain headline ab2048 ab16384 ab-engine small eager static engine compile"
for stage in "$@"; do
  [[ " $STAGES " == *" $stage "* ]] || { echo "study.sh: unknown stage '$stage' (stages: $STAGES)" >&2; exit 2; }
done
(( $# )) || { echo "study.sh: name a stage: $STAGES" >&2; exit 2; }
R=${R:-bench/results/$GPU-study}  # the probe, explain and A/B files
DB=${DB:-$R/$GPU.db}
mkdir -p "$R" "$(dirname "$DB")"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_CACHE=${FLOORLINE_CACHE:-/tmp/floorline-cache}
fl() { python3 -m floorline "$@"; }
MODELS=${MODELS:-qwen2.5-7b,llama-3.1-8b,mistral-7b-v0.3} CTX=${CTX:-2048,4096,8192,16384}
HEADLINE_MODEL=qwen2.5-7b
HEADLINE_PATHS=${HEADLINE_PATHS:-hf-eager,hf-static,hf-static+graphs,engine,engine-int4,engine-fp8,engine-int4-fp8head}
SMALL_MODELS=${SMALL_MODELS:-qwen3-0.6b,llama-3.2-1b}
# The paths whose steps Python launches kernel by kernel (hf-eager, hf-static) are timed until
# each cell's median is settled: its 95% interval (a block bootstrap, which the host's slow
# spells widen) within 5% of it, at most 2048 steps. On a shared host such a step may spread
# over 50-100% of its median, which 64 steps cannot pin down. The other paths' steps, replayed
# from a graph or the engine's, vary by about 1%: they keep 64 steps.
# Their warm-up is a fixed 128 steps: the automatic one waits for two windows of 32 steps to
# agree within 5%, which the same slow spells can deny it for good (on the lent H100, 3 of 11
# hf-eager cells stopped at its cap of 5 s, after 128 steps; the other 8 agreed after 64-128).
# A cell still getting faster after them fails on its drift, as before.
SETTLED="--steps auto --rel-width 0.05 --warmup 128"
ab() {  # ab A B CTX NAME: an A/B of 10 fresh sessions into $R/${GPU}_ab_NAME.json, carrying on
  # one that was cut off in $DB
  fl ab --db "$DB" --a "$1" --b "$2" --model $HEADLINE_MODEL --ctx "$3" --sessions 10 \
    --seed 2026 --resume --json > "$R/${GPU}_ab_$4.json"
  python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['sentence'])" "$R/${GPU}_ab_$4.json"
}
for stage in "$@"; do
  export FLOORLINE_RUN_LABEL="$(basename "$0") $stage"  # names the runs it makes
  case $stage in
    probe) fl probe --db "$DB" --model $HEADLINE_MODEL --json > "$R/${GPU}_probe.json" ;;
    explain)
      for path in ${EXPLAIN_PATHS:-hf-eager engine}; do
        fl explain --db "$DB" --model $HEADLINE_MODEL --ctx 2048 --path "$path" --json \
          > "$R/${GPU}_explain_${path//+/_}.json"
      done ;;
    headline)
      first=${FIRST:-1}
      launched=$(tr , '\n' <<< "$HEADLINE_PATHS" | { grep -Fx -e hf-eager -e hf-static || true; } | paste -sd,)
      others=$(tr , '\n' <<< "$HEADLINE_PATHS" | { grep -Fxv -e hf-eager -e hf-static || true; } | paste -sd,)
      for i in $(seq "$first" $((first + ${RUNS:-1} - 1))); do
        [[ -z $launched ]] || fl sweep --db "$DB" --models $HEADLINE_MODEL --ctx 2048 \
          --paths "$launched" $SETTLED --force --label "headline-$i"
        [[ -z $others ]] || fl sweep --db "$DB" --models $HEADLINE_MODEL --ctx 2048 \
          --paths "$others" --force --label "headline-$i"
      done ;;
    ab2048 | ab16384) ab hf-static hf-static+graphs "${stage#ab}" "${stage#ab}" ;;
    ab-engine) ab hf-static+graphs engine 2048 engine_2048 ;;
    small) fl sweep --db "$DB" --models "$SMALL_MODELS" --ctx 128,2048 --paths hf-static+graphs,engine ;;
    eager) fl sweep --db "$DB" --models "$MODELS" --ctx "$CTX" --paths hf-eager $SETTLED ;;
    static)
      fl sweep --db "$DB" --models "$MODELS" --ctx "$CTX" --paths hf-static $SETTLED
      fl sweep --db "$DB" --models "$MODELS" --ctx "$CTX" --paths hf-static+graphs ;;
    engine)
      fl sweep --db "$DB" --models "$MODELS" --ctx "$CTX" --paths engine,engine-int4,engine-fp8
      fl sweep --db "$DB" --models "$MODELS" --ctx 16384 --paths engine-kvfp8 ;;
    compile) fl sweep --db "$DB" --models "$MODELS" --ctx "$CTX" --paths hf-static+compile+graphs ;;
  esac
done
# one self-contained file to commit: the write-ahead log folded in and removed (unless another
# process has the database open)
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$DB" 2>/dev/null || true
fl show --db "$DB" --json > "${DB%.db}_cells.json"
fl show --db "$DB" --csv > "${DB%.db}_cells.csv"
fl show --db "$DB"
