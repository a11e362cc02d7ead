#!/usr/bin/env bash
# A/B of the MoE layer benchmark across commits, on one machine draw, in one device call.
#
# The GPU machines' host speed differs between draws by more than the margins being measured
# (docs/perf_notes.md v5.0, v5.1), so two versions are compared in the same call,
# interleaved: A B A B ...
#
# 1. Dev machine: export the commits' sources (package, launchers, C++, configs) into
#    .ab/<name>/ (ignored by git), then carry them with the wheels:
#
#      bash scripts/ab_trees.sh prepare c3a54e9 HEAD
#      # device tool: carry [".whl", ".ab"]
#
# 2. GPU machine (or the CPU with `--device cpu --model tiny`):
#
#      source scripts/device_setup.sh && bash scripts/ab_trees.sh run --rounds 2 \
#          .ab/c3a54e9 .ab/HEAD -- --model qwen3-30b-a3b --layouts tp2 ep2 \
#          --seq-lengths 32768 --baselines off-grouped --iters 20
#
#    Every round runs launch/bench_layer.py of each tree in turn (torchrun over --nproc
#    processes, default 2; 1: plain python) with that tree first on PYTHONPATH (and $MO_SITE,
#    the wheels device_setup.sh installed), the C++ extensions built in the tree first where
#    they are not. Rows go to $OUT/ab/<tree>.jsonl (rounds appended; git_sha = the prepared
#    tree's commit; a tree's earlier rows there are removed first), logs to
#    $OUT/ab/<tree>_r<round>.log; at the end a table: p50 ms of every (workload, variant)
#    per tree and round, and each tree's t_variant / t_on per round. --rounds / --nproc go
#    before the trees, bench_layer.py's options after `--`; the trees' folder names must
#    differ (they name the files).
#
# Exit status: 0 when every run exited 0, else 1; 2 on bad usage.
set -o pipefail

usage() {
  sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

root="$(cd "$(dirname "$0")/.." && pwd)" || exit 2
ab_dir=${AB_DIR:-$root/.ab}

prepare() {
  (( $# >= 1 )) || usage
  local rev sha name path
  local -a shas=() paths
  for rev in "$@"; do  # every commit checked before anything is written
    sha=$(git -C "$root" rev-parse --verify --quiet "$rev^{commit}") || {
      echo "ab_trees.sh prepare: '$rev' is not a commit of $root" >&2
      exit 2
    }
    git -C "$root" cat-file -e "$sha:launch/bench_layer.py" 2>/dev/null || {
      echo "ab_trees.sh prepare: commit '$rev' has no launch/bench_layer.py" >&2
      exit 2
    }
    shas+=("$sha")
  done
  local i=0
  for rev in "$@"; do
    sha=${shas[i]}
    i=$((i + 1))
    name=${rev//\//_}
    rm -rf "${ab_dir:?}/$name"
    mkdir -p "$ab_dir/$name" || exit 2
    # only what the layer benchmark imports and builds (the results and docs stay behind;
    # tests/support: its CPU runs patch Megatron from there), where the commit has it
    paths=()
    for path in megatron_overlap launch csrc configs setup.py pyproject.toml \
        tests/__init__.py tests/support; do
      git -C "$root" cat-file -e "$sha:$path" 2>/dev/null && paths+=("$path")
    done
    git -C "$root" archive "$sha" -- "${paths[@]}" | tar -x -C "$ab_dir/$name" || exit 2
    echo "$sha" >"$ab_dir/$name/AB_COMMIT"
    echo "prepared $ab_dir/$name ($sha, $(du -sh "$ab_dir/$name" | cut -f1))"
  done
  echo "carry: [\".whl\", \".ab\"] (with AB_DIR elsewhere, carry that folder instead)"
}

run() {
  local rounds=2 nproc=2
  while (( $# )); do
    case $1 in
      --rounds|--nproc)
        (( $# >= 2 )) || { echo "ab_trees.sh run: $1 takes a positive integer" >&2; exit 2; }
        if [[ $1 == --rounds ]]; then rounds=$2; else nproc=$2; fi
        shift 2 ;;
      --) break ;;
      -*) echo "ab_trees.sh run: unknown option $1" >&2; usage ;;
      *) break ;;
    esac
  done
  [[ $rounds =~ ^[1-9][0-9]*$ && $nproc =~ ^[1-9][0-9]*$ ]] || {
    echo "ab_trees.sh run: --rounds and --nproc take positive integers" >&2
    exit 2
  }
  local -a trees=()
  while (( $# )) && [[ $1 != -- ]]; do
    if [[ $1 == -* ]]; then
      echo "ab_trees.sh run: '$1' after the trees: --rounds / --nproc go before them," \
           "bench_layer.py's options after '--'" >&2
      exit 2
    fi
    [[ -f $1/launch/bench_layer.py ]] || {
      echo "ab_trees.sh run: $1 has no launch/bench_layer.py (make it with" \
           "'ab_trees.sh prepare <commit>', or give the repository root)" >&2
      exit 2
    }
    trees+=("$(cd "$1" && pwd)")
    shift
  done
  local dup
  dup=$(for tree in "${trees[@]}"; do basename "$tree"; done | sort | uniq -d | head -1)
  if [[ -n $dup ]]; then
    echo "ab_trees.sh run: two trees are named '$dup': their rows and logs would mix" \
         "(prepare the other under another name, or copy it)" >&2
    exit 2
  fi
  [[ ${1:-} == -- ]] && shift
  (( ${#trees[@]} >= 1 )) || usage
  local out="${OUT:-$root/results}/ab"
  mkdir -p "$out" || exit 2
  out=$(cd "$out" && pwd) || exit 2  # absolute: the runs start inside the trees
  for tree in "${trees[@]}"; do  # this call's rows only
    rm -f "$out/$(basename "$tree").jsonl" "$out/$(basename "$tree")"_r*.log
  done
  local site=${MO_SITE:-/tmp/site} status=0 tree name r rc
  local -a launch
  if (( nproc == 1 )); then
    launch=(python3)
  else
    launch=(python3 -m torch.distributed.run --standalone "--nproc_per_node=$nproc")
  fi
  for tree in "${trees[@]}"; do
    if [[ -f $tree/setup.py && -d $tree/csrc ]] \
        && ! compgen -G "$tree/megatron_overlap/resource/_solver*.so" >/dev/null; then
      (cd "$tree" && python3 setup.py -q build_ext --inplace >"$out/build_$(basename "$tree").log" 2>&1) \
        || echo "ab_trees.sh: building $tree's C++ extensions failed (see" \
                "$out/build_$(basename "$tree").log); it runs without them" >&2
    fi
  done
  for (( r = 1; r <= rounds; r++ )); do
    for tree in "${trees[@]}"; do
      name=$(basename "$tree")
      echo "== round $r: $name"
      # the rows' git_sha: the prepared tree's commit, else what the environment says
      (cd "$tree" && { [[ -f AB_COMMIT ]] && export MO_GIT_SHA=$(<AB_COMMIT); true; } \
        && PYTHONPATH="$tree:$site" TQDM_DISABLE=1 \
        "${launch[@]}" launch/bench_layer.py "$@" --out "$out/$name.jsonl" \
        >"$out/${name}_r$r.log" 2>&1)
      rc=$?
      grep -E "^layer " "$out/${name}_r$r.log" | sed "s/^/[$name r$r] /"
      if (( rc != 0 )); then
        echo "ab_trees.sh: $name round $r exited $rc (log $out/${name}_r$r.log)" >&2
        status=1
      fi
    done
  done
  python3 - "$out" "${trees[@]}" <<'EOF'
import json, os, sys
out, trees = sys.argv[1], [os.path.basename(t) for t in sys.argv[2:]]
table = {}
for tree in trees:
    path = os.path.join(out, f"{tree}.jsonl")
    if not os.path.isfile(path):
        continue
    rows = [json.loads(line) for line in open(path) if line.strip()]
    for row in sorted(rows, key=lambda r: r.get("timestamp", "")):
        key = (row["model"], row["layout"], row["seq_length"], row["variant"])
        table.setdefault(key, {}).setdefault(tree, []).append(row["ms_p50"])
if not table:
    sys.exit("ab_trees.sh: no rows")
print("\np50 ms per round (and t_variant / t_on per round):")
for key in sorted(table):
    on = table.get(key[:3] + ("on",), {})
    cells = []
    for tree in trees:
        ms = table[key].get(tree, [])
        ratio = [m / o for m, o in zip(ms, on.get(tree, []))] if key[3] != "on" else []
        cells.append(f"{tree}: " + " ".join(f"{m:.3f}" for m in ms)
                     + (" (" + " ".join(f"{x:.3f}" for x in ratio) + ")" if ratio else ""))
    print(f"{key[0]} {key[1]} {key[2]} {key[3]:12s} | " + " | ".join(cells))
EOF
  return $status
}

case ${1:-} in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@"; exit $? ;;
  *) usage ;;
esac
