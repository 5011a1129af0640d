#!/usr/bin/env bash
# One command from a fresh machine: set up, lint, type-check and run every test.
# Extra arguments go to pytest (e.g. scripts/test.sh -k failures, scripts/test.sh tests/kernel).
# --fast: the same set-up and checks, then only the unit tier (tests/unit and the contract suite's scripted row: well under a minute).
# The full run is two pytest runs (docs/testing.md): every test not marked serial on
# $AIR_MAGIC_TEST_WORKERS pytest-xdist workers (default 2), then the serial ones alone.
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
# Each check on its own line: under `set -e` a failure on the left of `&&` would not stop the script.
echo "== ruff";   "$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
echo "== mypy";   "$venv/bin/mypy"
if [ "$fast" = 1 ]; then
    echo "== pytest (fast: the unit tier)"; "$venv/bin/python" -m pytest -m unit tests/unit tests/contract ${args[@]+"${args[@]}"}
    exit
fi
# A -m EXPR of the caller's narrows both parts (pytest keeps only the last -m it is given).
marks=""
rest=()
expect_marks=0
for arg in ${args[@]+"${args[@]}"}; do
    if [ "$expect_marks" = 1 ]; then marks=$arg; expect_marks=0; continue; fi
    case "$arg" in
        -m | --markexpr) expect_marks=1 ;;
        --markexpr=*) marks=${arg#--markexpr=} ;;
        -m?*) marks=${arg#-m} ;;
        *) rest+=("$arg") ;;
    esac
done
both() { if [ -n "$marks" ]; then echo "($marks) and $1"; else echo "$1"; fi; }
workers=${AIR_MAGIC_TEST_WORKERS:-2}
echo "== pytest (every test not marked serial, $workers workers)"
parallel=0
"$venv/bin/python" -m pytest -n "$workers" --dist loadgroup -m "$(both "not serial")" ${rest[@]+"${rest[@]}"} \
    || parallel=$?
[ "$parallel" = 2 ] && exit 2  # interrupted (Ctrl-C): no second part
echo "== pytest (the serial tests, alone)"
serial=0
"$venv/bin/python" -m pytest -m "$(both serial)" ${rest[@]+"${rest[@]}"} || serial=$?
# 5: a part's selection was empty (say -k picked only serial tests); an error only if both were.
if [ "$parallel" = 5 ] && [ "$serial" = 5 ]; then exit 5; fi
[ "$parallel" = 5 ] && parallel=0
[ "$serial" = 5 ] && serial=0
[ "$parallel" != 0 ] && exit "$parallel"
exit "$serial"
