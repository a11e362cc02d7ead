#!/usr/bin/env bash
# Everything docs/report.md needs, on the 2-GPU machine, in one device call (the operator
# benchmark, launch/bench_op.py, is separate). Device tool: kind nvidia-h200-x2, carry
# [".whl"], command:
#
#   source scripts/device_setup.sh && bash scripts/gpu_bench_all.sh
#
# Writes to $OUT (default results/gpu_bench): layer.jsonl, prefill.jsonl, gpu_bench.log,
# report.md, report_layer.png, report_prefill.png (6 files; the tool returns at most 8).
#
# Phases, most important first; each is cut (SIGTERM, then SIGKILL) when its share of the
# time budget is spent, and the launchers write their rows as they finish each (layout,
# model) / model, so a cut phase keeps what it finished:
#   1. layer grid (launch/bench_layer.py): 5 models (fine-grained first) x {ep2, tp2 + SP} x
#      seq 4096 8192 16384 32768; 3 warm-up + 20 timed forwards per variant; variants on,
#      off (SequentialMLP), off-grouped (grouped GEMM), off-te (skipped: no TE on the image).
#   2. full-model prefill (launch/prefill.py), layout ep2: the same 5 models, 2 MoE layers
#      each (DeepSeek-V2-Lite: + its dense first layer), SDPA attention, same sequence
#      lengths, 2 warm-up + 10 timed forwards, variants off / on / off-grouped, fp32
#      reference check where it fits in memory.
#   3. the same prefill, layout tp2 + SP.
#   4. python -m megatron_overlap.bench.make_report over the rows -> $OUT/report.md + PNGs.
# Wall time measured on 2x H200 (commits b4da448 / fc20191): layer grid 109 s (all 40
# workloads); prefill EP2 did not finish 5 models in 68 s (the split of a 250 s budget)
# and took ~100 s on its own; prefill TP2 67 s. So ~5 min in all: the default 480 s budget
# fits; with less, the later phases are cut (their finished models' rows stay).
#
# MO_WITH_OP=1 adds the operator grid (launch/bench_op.py, 4 models x 4096 / 16384 tokens x
# ep / tp; bench_op.jsonl + bench_op.png: 8 files in all) after the layer grid, with 20 % of
# what is left of the budget (added in v4.2; its bench_op command ran, this wrapper not yet).
# MO_PREREDUCE=auto|on|off sets the combine mode of the flag-on variant of the layer grid
# and the prefill (`--prereduce`; default: the launchers' default, auto: the resource
# manager picks per call). Rows carry "prereduce" (true / false / "auto"); give
# make_report rows of one setting at a time: it lists the settings and warns on a mix.
# Knobs (environment): MO_BUDGET_S (default 480: seconds for phases 1-3), MO_MODELS
# (space-separated), MO_SEQS, MO_LAYER_ITERS (20), MO_PREFILL_ITERS (10), MO_MOE_LAYERS (2),
# MO_NPROC (2: GPUs used), MO_LAYOUTS (default "ep<N> tp<N>"; tpXepY names with
# X * Y = MO_NPROC, e.g. MO_NPROC=4 MO_LAYOUTS="tp2ep2 ep4 tp4"): the layer grid runs them
# all, the prefill one phase each (the phases share what is left of the budget).
# Exit status: 0 when every phase finished and every variant agreed with flag off, else 1
# (the report is written either way).
set -o pipefail

if [[ "${NCCL_NVLS_ENABLE:-}" != 0 || "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" != 1 \
      || "${NVSHMEM_DISABLE_NVLS:-}" != 1 ]]; then
  echo "gpu_bench_all.sh: NVLink multicast is not switched off; run" \
       "'source scripts/device_setup.sh && bash scripts/gpu_bench_all.sh'" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-results/gpu_bench}
mkdir -p "$out" || exit 2
log="$out/gpu_bench.log"
budget=${MO_BUDGET_S:-480}
models=${MO_MODELS:-"qwen3-30b-a3b deepseek-v2-lite qwen1.5-moe-a2.7b mixtral-8x7b phi-3.5-moe"}
seqs=${MO_SEQS:-"4096 8192 16384 32768"}
nproc=${MO_NPROC:-2}
export TQDM_DISABLE=1 MO_STACK_DUMP_S=${MO_STACK_DUMP_S:-150}
start=$(date +%s)
status=0
extra=()
[[ -n ${MO_PREREDUCE:-} ]] && extra=(--prereduce "$MO_PREREDUCE")

left() { echo $(( budget - ($(date +%s) - start) )); }

# run_phase NAME SHARE_PERCENT_OF_WHAT_IS_LEFT COMMAND...
run_phase() {
  local name=$1 share=$2 limit
  shift 2
  limit=$(( $(left) * share / 100 ))
  if (( limit < 45 )); then
    echo "== $name: SKIPPED (only ${limit}s of the budget left)" | tee -a "$log"
    status=1
    return
  fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$log"
  local t0=$(date +%s) rc
  timeout --signal=TERM --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$log" \
    | grep -v -i -E "warn|^\s*$|return func|all_to_all_single\(|^  warnings\.warn" \
    | grep -E "^layer |^\| |^prefill:|skipping|ERROR|Error|error:|Traceback|rows|^==" \
    | cut -c1-400
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s$( ((rc == 124)) && echo ' (TIME LIMIT: rows of unfinished models are missing)')" | tee -a "$log"
  (( rc == 0 )) || status=1
}

python3 - <<'EOF' 2>&1 | tee -a "$log"
import torch
print("== GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
      "| torch", torch.__version__)
EOF

# shellcheck disable=SC2086  # word splitting of the model and sequence lists is intended
layouts=${MO_LAYOUTS:-"ep$nproc tp$nproc"}
prefill_layouts=()
for name in $layouts; do
  if [[ ! $name =~ ^(tp([0-9]+))?(ep([0-9]+))?$ || -z $name ]]; then
    echo "gpu_bench_all.sh: MO_LAYOUTS entry '$name': expected epN, tpN or tpXepY" >&2
    exit 2
  fi
  prefill_layouts+=("--tp ${BASH_REMATCH[2]:-1} --ep ${BASH_REMATCH[4]:-1}")
done
# shellcheck disable=SC2086
run_phase "layer grid" 45 torchrun --standalone --nproc_per_node "$nproc" launch/bench_layer.py \
  --model $models --seq-lengths $seqs --layouts $layouts \
  --warmup 3 --iters "${MO_LAYER_ITERS:-20}" --out "$out/layer.jsonl" "${extra[@]}"

if [[ ${MO_WITH_OP:-0} == 1 ]]; then
  # The operator grid (~50 s on 2x H200 for these 16 workloads): bench_op.jsonl + .png.
  run_phase "operator grid" 20 torchrun --standalone --nproc_per_node "$nproc" \
    launch/bench_op.py --models qwen3-30b-a3b deepseek-v2-lite qwen1.5-moe-a2.7b mixtral-8x7b \
    --tokens 4096 16384 --layouts ep tp --warmup 3 --iters 20 --out "$out/bench_op.jsonl"
fi

left_phases=${#prefill_layouts[@]}
for layout in "${prefill_layouts[@]}"; do
  share=$(( 100 / left_phases ))
  left_phases=$(( left_phases - 1 ))
  # shellcheck disable=SC2086
  run_phase "prefill $layout" "$share" torchrun --standalone --nproc_per_node "$nproc" \
    launch/prefill.py --model $models --num-moe-layers "${MO_MOE_LAYERS:-2}" \
    --seq-lengths $seqs $layout --attention sdpa --baselines off off-grouped \
    --warmup 2 --iters "${MO_PREFILL_ITERS:-10}" --out "$out/prefill.jsonl" "${extra[@]}"
done

echo "== report" | tee -a "$log"
files=()
for f in "$out/layer.jsonl" "$out/prefill.jsonl"; do [[ -s $f ]] && files+=("$f"); done
if (( ${#files[@]} )); then
  python3 -m megatron_overlap.bench.make_report "${files[@]}" --out "$out/report.md" 2>&1 \
    | tee -a "$log"
  grep -E "^\* |^## " "$out/report.md"
else
  echo "no rows to report" | tee -a "$log"
  status=1
fi
echo "== done in $(( $(date +%s) - start ))s, exit $status" | tee -a "$log"
exit $status
