#!/usr/bin/env bash
# Runs the whole test suite (plus ruff and mypy) in its own virtual environment, .venv-test.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh "${MOE_FABRIC_TEST_VENV:-.venv-test}" "test,ucx,bench,ray"
venv="${MOE_FABRIC_TEST_VENV:-.venv-test}"
"$venv/bin/ruff" check .
"$venv/bin/mypy"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
