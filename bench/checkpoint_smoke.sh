#!/usr/bin/env bash
# A real (tiny) checkpoint through the GPU pipeline: save a random tiny-qwen2 as safetensors,
# then sweep it from its directory, so the load-from-disk path runs on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-}"  # names the runs it makes
ckpt=$(mktemp -d)
python3 - "$ckpt" <<'PY'
import sys, torch
from floorline.models import build_model, resolve_model
build_model(resolve_model("tiny-qwen2"), "cpu", torch.bfloat16, seed=3).save_pretrained(sys.argv[1])
PY
mkdir -p bench/results/h200-checkpoint
python3 -m floorline sweep --db bench/results/h200-checkpoint/h200_checkpoint.db --models "$ckpt" --ctx 128 \
  --paths hf-eager,hf-static,hf-static+graphs
# one self-contained file to commit: the write-ahead log folded in and removed
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" bench/results/h200-checkpoint/h200_checkpoint.db 2>/dev/null || true
