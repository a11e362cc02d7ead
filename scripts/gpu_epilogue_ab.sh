#!/usr/bin/env bash
# GPU checks and side-by-side measurements of the GEMM2 kernel's two variants of v5.2
# (docs/perf_notes.md v5.2), written in a session that had no GPU machine:
#   tma  the epilogue stores each tile through a TMA descriptor of its rows, asynchronously
#        (TileConfig.tma_store; the GPU default at world 1 since v5.9, opt-in at world > 1:
#        MEGATRON_OVERLAP_TMA_STORE=1)
#   rot  the static schedule's waves rotated over the CTAs (TileConfig.rotate)
# Device tool: kind nvidia-h200-x2 (the op and layer phases also run on one GPU, at world 1),
# carry [".whl"], one phase per call (each fits the 600 s limit):
#
#   source scripts/device_setup.sh && bash scripts/gpu_epilogue_ab.sh tests
#   source scripts/device_setup.sh && bash scripts/gpu_epilogue_ab.sh protocol
#   source scripts/device_setup.sh && bash scripts/gpu_epilogue_ab.sh op
#   source scripts/device_setup.sh && bash scripts/gpu_epilogue_ab.sh layer
#
#   tests     tests/gpu/test_triton_gpu.py's reference tests, world 2 then world 1 (each
#             case against the reference, and the TMA-store epilogue with and without
#             rotated waves bit for bit equal to the register-store tile); log
#             $OUT/gpu_tests.log
#   protocol  with MEGATRON_OVERLAP_TMA_STORE=1: back-to-back calls with a late finalize
#             (both modes), the timeout diagnosis, flag on vs flag off (world 2 and 1);
#             log $OUT/gpu_protocol.log
#   op     launch/bench_op.py, 5 models x 4096 / 16384 tokens per rank x EP / TP (EP only on
#          one GPU), the default tile (TMA at world 1, registers at world 2), the register
#          tile and the three other variants side by side in one run
#          (rows ours[<tile>] and nocomm[<tile>]); rows $OUT/bench_op_epilogue.jsonl
#   layer  launch/bench_layer.py, Qwen3-30B-A3B and DeepSeek-V2-Lite at 32768 tokens, EP2
#          and TP2 (EP1 on one GPU), two rounds (processes, each cut at its share of 560 s),
#          each timing 'on' (register stores: MEGATRON_OVERLAP_TMA_STORE=0) and 'on-alt' (--alt-env
#          MEGATRON_OVERLAP_TMA_STORE=1: the same layer, forwards interleaved) against
#          off-grouped; then a table per round; rows $OUT/layer_tma.jsonl
# OUT (default results/epilogue_ab) is relative to the caller's directory.
# MO_MODELS, MO_TOKENS (op), MO_SEQS (layer) override the lists.
set -o pipefail

usage="usage: bash scripts/gpu_epilogue_ab.sh tests|protocol|op|layer"
case "${1:-}" in
  tests|protocol|op|layer) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
if [[ "${NCCL_NVLS_ENABLE:-}" != 0 || "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" != 1 \
      || "${NVSHMEM_DISABLE_NVLS:-}" != 1 ]]; then
  echo "gpu_epilogue_ab.sh: NVLink multicast is not switched off; run" \
       "'source scripts/device_setup.sh && bash scripts/gpu_epilogue_ab.sh $1'" >&2
  exit 2
fi
out=${OUT:-results/epilogue_ab}
[[ "$out" = /* ]] || out="$PWD/$out"  # (relative to where it was called from)
cd "$(dirname "$0")/.." || exit 2
nproc=$(python3 -c "import torch; print(torch.cuda.device_count())") || exit 2
if [[ "$nproc" -lt 1 ]]; then
  echo "gpu_epilogue_ab.sh: no GPU" >&2
  exit 2
fi
nproc=$(( nproc >= 2 ? 2 : 1 ))
mkdir -p "$out" || exit 2
export TQDM_DISABLE=1

case "${1:-}" in
  tests)
    status=0
    : > "$out/gpu_tests.log"
    worlds="2 1"
    [[ "$nproc" -eq 1 ]] && worlds="1"
    for world in $worlds; do
      timeout 330 python3 -m pytest -q -ra -p no:cacheprovider \
        "tests/gpu/test_triton_gpu.py::test_triton_matches_reference[$world]" 2>&1 \
        | tee -a "$out/gpu_tests.log" | tail -8 || status=1
    done
    exit $status
    ;;
  protocol)
    MEGATRON_OVERLAP_TMA_STORE=1 timeout 570 python3 -m pytest tests/gpu/test_triton_gpu.py \
      -q -ra -p no:cacheprovider \
      -k "back_to_back or timeout_names or test_flag_on_triton_matches_flag_off" 2>&1 \
      | tee "$out/gpu_protocol.log" | tail -12
    ;;
  op)
    layouts="ep tp"
    [[ "$nproc" -eq 1 ]] && layouts="ep"
    # shellcheck disable=SC2086  # word lists
    timeout 570 torchrun --standalone --nproc_per_node "$nproc" launch/bench_op.py \
      --models ${MO_MODELS:-qwen3-30b-a3b deepseek-v2-lite qwen1.5-moe-a2.7b mixtral-8x7b phi-3.5-moe} \
      --tokens ${MO_TOKENS:-4096 16384} --layouts $layouts --warmup 3 --iters 20 \
      --variants 128x256x64w8s3 128x256x64w8s3tma 128x256x64w8s3rot 128x256x64w8s3tmarot \
      --out "$out/bench_op_epilogue.jsonl" 2>&1 | tee "$out/bench_op.log" | grep -v -i warn \
      | tail -70
    ;;
  layer)
    layouts="ep2 tp2"
    [[ "$nproc" -eq 1 ]] && layouts="ep1"
    rm -f "$out/layer_tma.jsonl" "$out/layer.log"
    status=0
    start=$(date +%s)
    # In one process per round, 'on' (register stores) and 'on-alt'
    # (MEGATRON_OVERLAP_TMA_STORE=1) are the same layer object, their forwards interleaved
    # (bench_layer.py --alt-env): the process's host speed, which moved whole processes by
    # up to 1.7x in v5.3's process-per-setting A/B, is common to both.
    for round in 1 2; do
      limit=$(( (560 - ($(date +%s) - start)) / (3 - round) ))
      (( limit < 10 )) && limit=10  # (timeout 0 would mean no limit)
      echo "== round $round (limit ${limit} s)"
      # shellcheck disable=SC2086
      MEGATRON_OVERLAP_TMA_STORE=0 timeout "$limit" torchrun --standalone \
        --nproc_per_node "$nproc" launch/bench_layer.py \
        --model ${MO_MODELS:-qwen3-30b-a3b deepseek-v2-lite} \
        --seq-lengths ${MO_SEQS:-32768} --layouts $layouts --baselines off-grouped \
        --alt-env MEGATRON_OVERLAP_TMA_STORE=1 \
        --warmup 3 --iters 20 --out "$out/layer_tma.jsonl" 2>&1 \
        | tee -a "$out/layer.log" | grep -v -i warn | tail -3 || status=1
    done
    python3 - "$out/layer_tma.jsonl" <<'EOF' || status=1
import json, sys
from collections import defaultdict
p50 = defaultdict(list)  # (model, layout, seq, variant) -> p50 of each round
for line in open(sys.argv[1]):
    r = json.loads(line)
    p50[(r["model"], r["layout"], r["seq_length"], r["variant"])].append(r["ms_p50"])
cells = sorted({k[:3] for k in p50})
print("| model | layout | seq | on, registers (rounds) | on-alt, TMA store (rounds) "
      "| TMA / registers (rounds) | off-grouped / on | off-grouped / on-alt |")
print("|---|---|---|---|---|---|---|---|")
for c in cells:
    on, alt, og = p50[c + ("on",)], p50[c + ("on-alt",)], p50[c + ("off-grouped",)]
    if not (on and alt and og) or len(on) != len(alt) or len(og) != len(on):
        continue
    print(f"| {c[0]} | {c[1]} | {c[2]} | {' '.join(f'{x:.3f}' for x in on)} | "
          f"{' '.join(f'{x:.3f}' for x in alt)} | "
          f"{' '.join(f'{b / a:.3f}' for a, b in zip(on, alt))} | "
          f"{' '.join(f'{g / a:.3f}' for a, g in zip(on, og))} | "
          f"{' '.join(f'{g / b:.3f}' for b, g in zip(alt, og))} |")
EOF
    exit $status
    ;;
esac
