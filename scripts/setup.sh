#!/usr/bin/env bash
# Idempotent setup shared by the README's two commands (scripts/demo.sh, scripts/test.sh):
#   system packages (numactl, cmake, ninja, g++, python3-venv, prometheus, iproute2) when missing and we may install them,
#   a virtual environment in .venv with orchestrator and its test extras,
#   llama-server/llama-bench/llama-fit-params built from the pinned llama.cpp source (cached; skipped when found).
# Environment: PYTHON (default python3), VENV (default .venv), ORCHESTRATOR_SKIP_BUILD=1 to skip the llama.cpp build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

need=()
command -v numactl >/dev/null || need+=(numactl)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v c++ >/dev/null || need+=(g++)
command -v git >/dev/null || need+=(git)
command -v prometheus >/dev/null || need+=(prometheus)   # tests/integration/test_prometheus.py scrapes with it
command -v ss >/dev/null || need+=(iproute2)   # tests/multigpu reads each RPC device's connection bytes with ss
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null; then
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    echo "setup: installing ${need[*]} (apt-get)" >&2
    $SUDO apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || {
      $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "${need[@]}" >/dev/null; }
  else
    echo "setup: please install: ${need[*]}" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.orchestrator-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing orchestrator and its dependencies into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q -e '.[test]'
  touch "$stamp"
fi

if [ "${ORCHESTRATOR_SKIP_BUILD:-0}" != 1 ]; then
  # $LLAMA_SERVER or a llama-server on PATH is used as it is; otherwise the pinned source with our patch series
  # (instant when that exact build is cached; a changed patch series builds again)
  if [ -z "${LLAMA_SERVER:-}" ] && ! command -v llama-server >/dev/null; then
    "$VENV/bin/orchestrator" build >/dev/null
  fi
fi
