#!/usr/bin/env bash
# The GPU validation of docs/gpu-validation.md, on a machine with NVIDIA GPUs.
#
#   scripts/gpu-validation.sh OUTDIR [tests] [parity] [metrics]     (default: all three)
#
# tests:   pytest -m gpu tests/gpu (NCCL, GPU subsets, no CUDA context in the caller or the
#          notebook kernel, the four example notebooks through nbclient with widget state)
# parity:  benchmarks/gpu_parity.py: every example under air_magic and torchrun, same seeds
# metrics: benchmarks/metrics_logging.py seed: the seed's example with and without MLflow logging
#
# Needs torch with CUDA, the project's notebook and mlflow extras, nbclient, and DeepSpeed
# (DS_BUILD_OPS=0 pip install deepspeed). Each part's output goes to OUTDIR/<part>.log.
set -uo pipefail
out=${1:?usage: scripts/gpu-validation.sh OUTDIR [tests] [parity] [metrics]}
shift
parts=${*:-tests parity metrics}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
# One fresh embedded MLflow store for the whole validation.
export AIR_MAGIC_MLFLOW_DIR=${AIR_MAGIC_MLFLOW_DIR:-$(mktemp -d)/mlflow}
py=${PYTHON:-python3}
status=0
for part in $parts; do
    start=$(date +%s)
    case $part in
        tests) $py -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider 2>&1 | tee "$out/tests.log" ;;
        parity) $py benchmarks/gpu_parity.py --json "$out/parity.json" 2>&1 | tee "$out/parity.log" ;;
        metrics) $py benchmarks/metrics_logging.py seed --json "$out/metrics.json" 2>&1 | tee "$out/metrics.log" ;;
        *) echo "unknown part: $part" >&2; exit 2 ;;
    esac
    rc=${PIPESTATUS[0]}
    echo "== $part: rc $rc in $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
    [ "$rc" = 0 ] || status=1
done
exit $status
