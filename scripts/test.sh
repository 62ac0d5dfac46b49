#!/usr/bin/env bash
# The README's test command: set up (see scripts/setup.sh), then run the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k planner -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
