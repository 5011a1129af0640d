#!/usr/bin/env bash
# One command from a fresh machine to a notebook: set up .venv with the jupyter extra (the cell
# magic and its tabs, JupyterLab, MLflow), then open examples/quickstart.ipynb in JupyterLab.
# The server listens on 127.0.0.1 only (this machine's browser; over SSH, forward its port), with
# Jupyter's token. Extra arguments go to `jupyter lab` (e.g. --port 8890, --no-browser).
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    case "$arg" in
        --ip | --ip=* | --ServerApp.ip | --ServerApp.ip=*)
            echo "notebook: the server listens on 127.0.0.1 only; for another address run jupyter lab yourself" >&2
            exit 2 ;;
    esac
done
scripts/setup.sh jupyter
venv=${AIR_MAGIC_VENV:-.venv}
exec "$venv/bin/jupyter" lab --ServerApp.ip=127.0.0.1 "$@" examples/quickstart.ipynb
