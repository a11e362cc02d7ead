#!/usr/bin/env bash
# One device call's worth of GPU checks: the GPU tests, then the Mixtral prefill at TP=1/EP=2
# and TP=2/EP=1 (SP), reference and Triton backends. Usage on the device machine:
#   source scripts/device_setup.sh && bash scripts/gpu_check.sh [pytest args...]
set -o pipefail
out=${OUT:-results}
mkdir -p "$out"
status=0
python3 -m pytest tests/gpu -q -ra -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -15 || status=1
for layout in "1 2" "2 1"; do
  set -- $layout
  for backend in reference triton; do
    echo "== prefill mixtral-8x7b 2 layers seq 4096 tp=$1 ep=$2 backend=$backend"
    torchrun --standalone --nproc_per_node 2 launch/prefill.py --model mixtral-8x7b \
      --num-layers 2 --seq-lengths 4096 --tp "$1" --ep "$2" --backend "$backend" \
      --warmup 2 --iters 10 --out "$out/prefill.jsonl" 2>&1 | tee -a "$out/prefill.log" \
      | grep -v -i "warn" | tail -8 || status=1
  done
done
exit $status
