#!/usr/bin/env bash
# One command from a fresh machine: set up, then train a small DDP model on every
# GPU here (or 2 CPU ranks with gloo when there is none).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh mlflow
exec "${AIR_MAGIC_VENV:-.venv}/bin/python" examples/quickstart.py "$@"
