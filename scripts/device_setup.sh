# shellcheck shell=bash
# Source this at the start of every command on the GPU machine (the `run` tool), with
# carry=[".whl"]:
#
#   source scripts/device_setup.sh && torchrun --nproc_per_node 2 launch/prefill.py ...
#
# It
#   1. exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
#      (NVLink multicast must stay off on those shared hosts) and PYTHONUNBUFFERED=1;
#   2. puts the repo root and $MO_SITE (default /tmp/site) in front of PYTHONPATH, so
#      `import megatron_overlap` works without a pip install;
#   3. installs the wheels carried in .whl/ into $MO_SITE (pip --target, offline), skipping
#      each one whose package is already importable at that version (megatron-core) or at a
#      version that satisfies what the carried wheels require (packaging);
#   4. builds the C++ extensions in place (`setup.py build_ext --inplace`, pybind11 from the
#      carried wheel): the resource solver (csrc/solver.cpp) and the GatherRS host layout
#      (csrc/layout.cpp), unless the builds for this Python are newer than their sources, and
#      checks that both import;
#   5. prints one line: python / torch / triton / megatron-core versions and the GPUs.
# It returns non-zero, with a message, when something is missing; it never `exit`s or
# changes the caller's shell options. Make .whl/ on the dev machine with
# scripts/fetch_device_wheels.sh. See docs/gpu.md.
#
# Overrides (for testing elsewhere): MO_SITE (install target), MO_PYTHON (interpreter).

_mo_device_setup() {
    # NVLink multicast off, first, whatever happens below.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export PYTHONUNBUFFERED=1

    local root site py whl
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    site="${MO_SITE:-/tmp/site}"
    py="${MO_PYTHON:-python3}"
    whl="$root/.whl"

    # PYTHONPATH = repo root : site : (previous entries, without those two)
    local p out=""
    local -a parts=()
    IFS=: read -r -a parts <<<"${PYTHONPATH:-}"
    for p in "${parts[@]}"; do
        [[ -z "$p" || "$p" == "$root" || "$p" == "$site" ]] && continue
        out="${out:+$out:}$p"
    done
    export PYTHONPATH="$root:$site${out:+:$out}"

    if ! command -v "$py" >/dev/null 2>&1; then
        echo "[device_setup] ERROR: '$py' not found" >&2
        return 1
    fi

    # Which carried wheels must be installed? (prints paths; exit 3 = no wheels carried,
    # exit 4 = two versions of one package)
    local todo rc
    todo="$("$py" - "$whl" <<'PYEOF'
import importlib.metadata as md
import re
import sys
import zipfile
from pathlib import Path

whl = Path(sys.argv[1])
wheels = sorted(whl.glob("*.whl")) if whl.is_dir() else []
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()

def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

def base(v):
    return v.split("+", 1)[0]

by_name, reqs = {}, {}
for w in wheels:
    name, ver = w.name.split("-")[:2]
    by_name.setdefault(norm(name), []).append((w, ver))
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode("utf-8", "replace").splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = line.split(":", 1)[1].split(";", 1)[0].strip()
                m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^)]*)\)?", req)
                if m:
                    reqs.setdefault(norm(m.group(1)), []).append(m.group(2).strip())

dups = {n: [w.name for w, _ in v] for n, v in by_name.items() if len(v) > 1}
if dups:
    print(f"[device_setup] ERROR: more than one version in .whl/: {dups}", file=sys.stderr)
    sys.exit(4)

# Requirements of the carried wheels that are neither carried nor installed.
for n, specs in reqs.items():
    if n not in by_name and installed(n) is None:
        want = " ".join([n] + [s for s in specs if s])
        print(f"[device_setup] WARNING: {want} is required but neither installed nor "
              "carried in .whl/", file=sys.stderr)

try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    SpecifierSet = None

def satisfies(have, specs):
    if SpecifierSet is None:
        return False
    try:
        return all(SpecifierSet(s).contains(base(have), prereleases=True) for s in specs if s)
    except Exception:
        return False

for n, [(w, ver)] in by_name.items():
    have = installed(n)
    if have is not None and (base(have) == base(ver) or (n in reqs and satisfies(have, reqs[n]))):
        continue  # already importable at this version, or at one that fits the requirement
    print(w)

if not wheels:
    # Nothing carried: fine only if megatron.core is already importable.
    import importlib.util
    sys.exit(0 if importlib.util.find_spec("megatron") and installed("megatron-core") else 3)
PYEOF
)"
    rc=$?
    if [[ $rc -eq 3 ]]; then
        cat >&2 <<EOF
[device_setup] ERROR: megatron-core is not installed and no wheels were found in $whl/.
[device_setup]   On the dev machine run:  scripts/fetch_device_wheels.sh
[device_setup]   then call the device tool with carry=[".whl"] (the folder is git-ignored, so it
[device_setup]   only travels when carried).
EOF
        return 1
    elif [[ $rc -ne 0 ]]; then
        echo "[device_setup] ERROR: could not inspect $whl/ (status $rc)" >&2
        return 1
    fi

    if [[ -n "$todo" ]]; then
        local -a files
        mapfile -t files <<<"$todo"
        mkdir -p "$site" || return 1
        if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "${files[@]}"; then
            echo "[device_setup] ERROR: pip install --target $site ${files[*]##*/} failed" >&2
            return 1
        fi
        echo "[device_setup] installed into $site: ${files[*]##*/}"
    fi

    # The C++ extensions, built next to their Python twins (rebuilt when a source is newer
    # than its built module); fails loudly: without them the plans come from the solver's
    # twin and the layouts from direct_layout_numpy.
    local suffix so layout_so
    suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" || return 1
    so="$root/megatron_overlap/resource/_solver$suffix"
    layout_so="$root/megatron_overlap/ops/_layout$suffix"
    if [[ ! -f "$so" || "$root/csrc/solver.cpp" -nt "$so" || "$root/setup.py" -nt "$so"
          || ! -f "$layout_so" || "$root/csrc/layout.cpp" -nt "$layout_so" ]]; then
        if ! (cd "$root" && "$py" setup.py -q build_ext --inplace >/tmp/mo_build_ext.log 2>&1); then
            echo "[device_setup] ERROR: building the C++ extensions failed (needs setuptools" \
                 "on the image and pybind11 from .whl/: run scripts/fetch_device_wheels.sh);" \
                 "log: /tmp/mo_build_ext.log" >&2
            tail -20 /tmp/mo_build_ext.log >&2
            return 1
        fi
        echo "[device_setup] built $(basename "$so") $(basename "$layout_so")"
    fi
    if ! "$py" -c "from megatron_overlap.resource import _solver" 2>/dev/null; then
        echo "[device_setup] ERROR: megatron_overlap.resource._solver does not import" >&2
        return 1
    fi
    if ! "$py" -c "from megatron_overlap.ops import _layout" 2>/dev/null; then
        echo "[device_setup] ERROR: megatron_overlap.ops._layout does not import" >&2
        return 1
    fi

    # One summary line; fails if torch or megatron.core cannot be imported.
    local gpus=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus="$(nvidia-smi -L 2>/dev/null | sed -nE 's/^GPU ([0-9]+): ([^(]*[^ (]).*/\1:\2/p' | paste -sd, -)"
    fi
    MO_GPUS="$gpus" MO_SITE_DIR="$site" "$py" -W ignore - <<'PYEOF'
import os
import platform
import sys

def ver(mod):
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        return f"MISSING({type(e).__name__})"

import torch
import megatron.core as mc

gpus = os.environ.get("MO_GPUS", "")
if gpus:
    n = len(gpus.split(","))
else:
    n = torch.cuda.device_count()
    gpus = ",".join(f"{i}:{torch.cuda.get_device_name(i)}" for i in range(n))
where = "site" if os.path.realpath(mc.__file__).startswith(
    os.path.realpath(os.environ["MO_SITE_DIR"])) else "image"
print(f"[device_setup] python {platform.python_version()} | torch {torch.__version__} "
      f"(cuda {torch.version.cuda}) | triton {ver('triton')} | megatron-core "
      f"{getattr(mc, '__version__', '?')} ({where}) | {n} GPU(s) [{gpus or 'none'}] | "
      f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} "
      f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST']} "
      f"NVSHMEM_DISABLE_NVLS={os.environ['NVSHMEM_DISABLE_NVLS']}")
PYEOF
    rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "[device_setup] ERROR: torch / megatron.core import failed (PYTHONPATH=$PYTHONPATH)" >&2
        return 1
    fi
    return 0
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "scripts/device_setup.sh must be sourced: source scripts/device_setup.sh && <command>" >&2
    exit 2
fi
_mo_device_setup_rc=0
_mo_device_setup "$@" || _mo_device_setup_rc=$?
unset -f _mo_device_setup
return "$_mo_device_setup_rc"
