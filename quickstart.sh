#!/usr/bin/env bash
# ./quickstart.sh demo   set up .venv, then run the main job (the study's sweep on a GPU; the
#                        tiny CPU demo without one), which prints its cells, and write the
#                        report to report/ (`floorline show` lists the database again)
# ./quickstart.sh test   set up .venv, then run the linter (ruff) and the test suite
# ./quickstart.sh setup  set up .venv only
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
if [[ ! -x $VENV/bin/floorline ]]; then
  # System packages stay visible so that a machine's own CUDA build of torch is used as it is.
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e '.[test]'
fi
case "${1:-}" in
  setup) ;;
  demo) "$VENV/bin/floorline" sweep && "$VENV/bin/floorline" report --out report ;;
  test) "$VENV/bin/ruff" check src tests bench && "$VENV/bin/python" -m pytest -q ;;
  *) echo "usage: ./quickstart.sh demo|test|setup" >&2; exit 2 ;;
esac
