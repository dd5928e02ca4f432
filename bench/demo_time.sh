#!/usr/bin/env bash
# The CPU demo as a new user runs it, timed: a fresh clone of this repository's HEAD, an empty
# home (so an empty pip cache and the model downloaded), `./quickstart.sh demo`. With `avx2`,
# ATen and oneDNN are held to the kernels a processor without AVX-512 runs.
#   bash bench/demo_time.sh OUT NAME [avx2]
# writes OUT/NAME.log (the demo's output, then a line with its exit code and seconds) and
# OUT/NAME.db (its cells).
set -u
out=$(realpath "$1") name=$2
work=$(mktemp -d) home=$(mktemp -d)
git clone -q "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" "$work/floorline"
cd "$work/floorline"
unset PYTHONDONTWRITEBYTECODE  # the demo compiles its bytecode as a user's machine would
if [[ ${3:-} == avx2 ]]; then export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2; fi
start=$(date +%s.%N)
HOME=$home ./quickstart.sh demo > "$out/$name.log" 2>&1
rc=$?
end=$(date +%s.%N)
echo "rc=$rc seconds=$(python3 -c "print($end - $start)") commit=$(git rev-parse --short HEAD)" \
  "host=${3:-native}" >> "$out/$name.log"
cp floorline.db "$out/$name.db"
rm -rf "$work" "$home"
exit $rc
