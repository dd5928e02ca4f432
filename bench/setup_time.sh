#!/usr/bin/env bash
# The set-up's install timed two ways, alternating, each into a new virtual environment with the
# pip cache as it is (warm after the first): pip compiling every file to bytecode itself (one
# core), and quickstart.sh's way, pip without bytecode then compileall on every core.
#   bash bench/setup_time.sh [RUNS]   (default 3 of each; prints each run, then each way's median)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
ENV_DIR=$(mktemp -d)
trap 'rm -rf "$ENV_DIR"' EXIT
echo "$(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for i in $(seq "$RUNS"); do
  for way in pip parallel; do
    rm -rf "$ENV_DIR/v"
    python3 -m venv --system-site-packages "$ENV_DIR/v"
    start=$(date +%s.%N)
    if [[ $way == pip ]]; then
      "$ENV_DIR/v/bin/python" -m pip install -q -e . torch==2.13.0 > /dev/null 2>&1
    else
      "$ENV_DIR/v/bin/python" -m pip install -q --no-compile -e . torch==2.13.0 > /dev/null 2>&1
      "$ENV_DIR/v/bin/python" -m compileall -q -j 0 "$("$ENV_DIR/v/bin/python" -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
    fi
    echo "$way $i $(echo "$(date +%s.%N) - $start" | bc)"
  done
done | tee "$ENV_DIR/runs.txt"
python3 - "$ENV_DIR/runs.txt" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    way, _, seconds = line.split()
    runs.setdefault(way, []).append(float(seconds))
for way, s in runs.items():
    print(f"{way}: {statistics.median(s):.1f} s (median of {len(s)}, {min(s):.1f}-{max(s):.1f} s)")
PY
