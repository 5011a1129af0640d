#!/usr/bin/env bash
# Set up a virtual environment for air_magic: torch that fits this machine, then
# air_magic itself (editable) with the extras named in $1 (e.g. "test").
#
#   scripts/setup.sh [EXTRAS]
#
# Environment: AIR_MAGIC_VENV (default .venv), PYTHON (default python3).
# torch: with an NVIDIA driver, the default (CUDA) build from PyPI; without one,
# the CPU build (a local wheel when pip has one, else PyTorch's CPU index), so a
# CPU machine does not download gigabytes of CUDA libraries it cannot use.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${AIR_MAGIC_VENV:-.venv}
python=${PYTHON:-python3}
extras=${1:-}

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# pip byte-compiles what it installs (half the install's time). Not --no-compile: where
# PYTHONDONTWRITEBYTECODE is set (CI machines, this one) nothing is compiled later either, and
# every process recompiles what it imports: the test suite ran 1.8x slower that way.
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found; installing torch (CUDA build)"
        "${pip[@]}" "torch>=2.2"
    else
        echo "setup: no NVIDIA GPU; installing the CPU build of torch"
        "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
            || "${pip[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch>=2.2,<2.15"
    fi
fi

if [ -n "$extras" ]; then
    "${pip[@]}" -e ".[$extras]"
else
    "${pip[@]}" -e .
fi
# An editable install compiles nothing of air_magic itself: with PYTHONDONTWRITEBYTECODE set, every
# rank, caller and starter would compile its modules again (0.1 s of CPU a process, measured).
# Python checks each .pyc against its source, so an edited module is still read from the source.
"$venv/bin/python" -m compileall -q air_magic
# DeepSpeed (the test extra) compiles its shared-memory CPU op with ninja the first time a process
# calls init_distributed on the CPU (about 25 s, then cached in ~/.cache/torch_extensions): built
# here, with the rest of the install, rather than inside the first test that touches it.
if "$venv/bin/python" -c "import deepspeed" >/dev/null 2>&1 \
    && ! command -v nvidia-smi >/dev/null 2>&1; then
    "$venv/bin/python" -c "
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)" >/dev/null 2>&1 \
        || echo "setup: DeepSpeed's CPU op was not built here (its first use builds it)"
fi
echo "setup: ready in $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
