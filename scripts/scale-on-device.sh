#!/usr/bin/env bash
# Issue 34's runs on a 16-core GPU host with CPU ranks (docs/gpu-validation.md, docs/benchmarks.md
# "At scale"):
#
#   scripts/scale-on-device.sh OUTDIR local     real ranks up to 512, a failure among 256, the 256-rank
#                                               test, 1,000 synthetic ranks
#   scripts/scale-on-device.sh OUTDIR ray       125 simulated Ray nodes x 8 fake GPUs: 1,000 ranks placed
#                                               and started, then a node lost among them
#
# Needs the project's mlflow extra (local) or ray extra (ray), pytest and pytest-timeout. Each part's
# output goes to OUTDIR/<part>.log; JSON rows are the benchmarks' own.
set -uo pipefail
out=${1:?usage: scripts/scale-on-device.sh OUTDIR local|ray}
part=${2:?usage: scripts/scale-on-device.sh OUTDIR local|ray}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true AIR_MAGIC_FORCE_CPU=1 AIR_MAGIC_MLFLOW_UI=0
export AIR_MAGIC_MLFLOW_DIR=${AIR_MAGIC_MLFLOW_DIR:-$(mktemp -d)/mlflow}
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...: one timed step, its output in OUTDIR/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout -s INT -k 20 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: rc $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    grep '^{' "$out/$name.log" | tee -a "$out/rows.jsonl"
}
nproc | sed 's/^/cores: /' | tee -a "$out/summary.txt"
case $part in
    local)
        step scale 200 $py benchmarks/scale.py --ranks 8 32 64 128 256 512
        step root-cause 100 $py benchmarks/root_cause_time.py 8 64 256
        step test-256 150 $py -m pytest -p no:cacheprovider -q tests/process/test_scale.py -k 256_real
        tail -3 "$out/test-256.log"
        step synthetic 60 $py benchmarks/scale.py --synthetic --ranks 1000 --seconds 20
        ;;
    ray)
        step ray-scale 560 $py benchmarks/ray_scale.py --nodes 125 --gpus-per-node 8 --lose-node
        tail -5 "$out/ray-scale.log"
        ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
esac
