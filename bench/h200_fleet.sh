#!/usr/bin/env bash
# A sweep through `--cluster local-cuda` (one Dask worker per GPU; one here) beside the same grid
# swept in one process: per-cell medians of the graph-replayed paths should agree within 1%.
# Resumable, so each stage fits in one call:
#   bash bench/h200_fleet.sh wheels      on a machine with a package registry: Dask's wheels
#                                        for Python 3.12 on x86-64 Linux into .whl/fleet/
#   bash bench/h200_fleet.sh setup       on the GPU machine: install them from .whl/fleet/
#                                        without a registry (PIP_ARGS adds pip options)
#   bash bench/h200_fleet.sh inprocess   the grid in one process, into $LOCAL_DB
#   bash bench/h200_fleet.sh fleet       the same grid through --cluster local-cuda, into $FLEET_DB
#   bash bench/h200_fleet.sh compare     fleet/in-process per cell (bench/fleet_compare.py)
# The grid: the study's models and contexts on two graph-replayed paths (whose medians the
# comparison holds to 1%); MODELS, CTX and PATHS change it (PATHS=hf-eager,... adds the eager path).
# Wheels carried to the GPU machine (dask[distributed] 2026.8.0 and what it needs, about 5.3 MB):
#   dask distributed cloudpickle click fsspec importlib_metadata jinja2 lazy_importer locket
#   markupsafe msgpack packaging partd psutil pyyaml sortedcontainers tblib toolz tornado zict zipp
# Files for the results folder go to $OUT (the device tool's) or bench/results/h200-fleet/.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-bench/results/h200-fleet}
LOCAL_DB=${LOCAL_DB:-bench/results/h200-fleet/h200_fleet_inprocess.db}
FLEET_DB=${FLEET_DB:-bench/results/h200-fleet/h200_fleet.db}
mkdir -p "$DEST" "$(dirname "$LOCAL_DB")" "$(dirname "$FLEET_DB")"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-}"  # names the runs it makes
export FLOORLINE_CACHE=${FLOORLINE_CACHE:-/tmp/floorline-cache}
fl() { python3 -m floorline "$@"; }
MODELS=${MODELS:-qwen2.5-7b,llama-3.1-8b,mistral-7b-v0.3} CTX=${CTX:-2048,4096,8192,16384}
PATHS=${PATHS:-hf-static+graphs,engine}
DASK='dask[distributed]>=2025.4,<2027'

case ${1:?stage} in
  wheels)
    python3 -m pip download --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 -d .whl/fleet "$DASK"
    ls -l .whl/fleet ;;
  setup)
    # shellcheck disable=SC2086
    python3 -m pip install --no-index --find-links .whl/fleet ${PIP_ARGS:-} "$DASK"
    python3 -c "import distributed; print('distributed', distributed.__version__)" ;;
  inprocess) fl sweep --db "$LOCAL_DB" --models "$MODELS" --ctx "$CTX" --paths "$PATHS"
    python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$LOCAL_DB" 2>/dev/null || true ;;  # no -wal file to commit
  fleet) fl sweep --cluster local-cuda --db "$FLEET_DB" --models "$MODELS" --ctx "$CTX" --paths "$PATHS"
    python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$FLEET_DB" 2>/dev/null || true ;;
  compare) python3 bench/fleet_compare.py "$LOCAL_DB" "$FLEET_DB" --json "$DEST/h200_fleet_compare.json" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
