#!/usr/bin/env bash
# One command from a fresh machine: set up, lint, type-check and run every test.
# Extra arguments go to pytest (e.g. scripts/test.sh -k failures).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
venv=${AIR_MAGIC_VENV:-.venv}
echo "== ruff";   "$venv/bin/ruff" check . && "$venv/bin/ruff" format --check .
echo "== mypy";   "$venv/bin/mypy"
echo "== pytest"; "$venv/bin/python" -m pytest "$@"
