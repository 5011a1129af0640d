#!/usr/bin/env bash
# One command from a fresh machine: set up, lint, type-check and run every test.
# Extra arguments go to pytest (e.g. scripts/test.sh -k failures).
# --fast: the same set-up and checks, then only the tests not marked slow (under a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for arg in "$@"; do
    if [ "$arg" = --fast ]; then fast=1; else args+=("$arg"); fi
done
scripts/setup.sh test
venv=${AIR_MAGIC_VENV:-.venv}

# The browser test drives Debian's chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test: installing Debian's chromium for the browser test"
        apt-get install -y -q chromium >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
            || echo "test: could not install chromium; the browser test will be skipped"
    else
        echo "test: /usr/bin/chromium is missing (apt-get install chromium); the browser test will be skipped"
    fi
fi
echo "== ruff";   "$venv/bin/ruff" check . && "$venv/bin/ruff" format --check .
echo "== mypy";   "$venv/bin/mypy"
if [ "$fast" = 1 ]; then
    echo "== pytest (fast: not slow)"; "$venv/bin/python" -m pytest -m "not slow" ${args[@]+"${args[@]}"}
else
    echo "== pytest"; "$venv/bin/python" -m pytest "$@"
fi
