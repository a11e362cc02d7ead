"""Compile the GEMM2 + scatter kernel for Hopper (sm_90) on a machine without a GPU.

    python3 launch/compile_sm90.py --topk 8 --experts-pow2 128 --tma-store --out /tmp/sm90
    python3 launch/compile_sm90.py --tile 256x128x64 --num-stages 4   # WIDE_TILE
    python3 launch/compile_sm90.py --compare /path/to/other/checkout   # SASS identical?

Triton compiles `_gemm_scatter_kernel` with the specialisations a GPU launch gives it (bf16,
16-byte-aligned pointers, F, H and the strides divisible by 16: their values are not
specialised on, so one compiled kernel serves every such shape; the finalize index's
top-k, expert count rounded up to a power of two and TP size are), through its own
bundled ptxas, and prints the kernel's shared memory, the count of a few instructions of
interest in its PTX (TMA copies, bulk waits, proxy fences, barriers, wgmma) and where the
TTGIR waits for the epilogue's TMA store (right after it: synchronous; before the next
tile's store into the same buffer: asynchronous), and whether every arrival signal follows
a full wait for the TMA stores, a proxy fence and a barrier in the PTX
(`signals_after_bulk_wait`; null without TMA stores), and the global stores by width
(`global_stores`: e.g. {"st.global.v4.b32": 16, ...}; the register epilogue's tile is 16
bytes per store where the pointer hints hold, one element per store, `st.global.b16`, where
they do not; `--reduce-send` adds the pre-reduced send kernel's). `--out DIR` keeps the
PTX, TTGIR and cubin. `--compare TREE` compiles the same kernel from another checkout of
this repository (e.g. `git worktree add /tmp/base HEAD`) and says whether the two SASS
listings are identical (addresses stripped), which is how a change can be shown to leave a
compiled variant untouched without a GPU. Use the Triton version of the GPU machine for findings
that matter there (`pip install --target DIR triton==3.6.0`, then `PYTHONPATH=DIR`):
the pipeliner differs between versions (Triton 3.9 keeps the TMA-store epilogue
synchronous where 3.6 makes it asynchronous, docs/perf_notes.md v5.2).

Exit status 0, or 2 with a message for bad arguments or a Triton without the CUDA backend.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

KERNEL_ARGS = dict(
    h_ptr="*bf16", w2_ptr="*bf16", tiles_ptr="*i32", num_remote="i32", num_local="i32",
    counters_ptr="*i32", peer_recv_ptrs="*i64", local_ptr="*bf16", peer_sig_ptrs="*i64",
    sig_ptr="*i64", my_rank="i32", num_ranks="i32", num_comm="i32", freed_target="i64",
    timeout_ns="i64", err_ptr="*i64", N="i32", F="i32", H="i32", L="i32", stride_h="i32",
    stride_wl="i32", stride_wn="i32", rmap_ptr="*u8", counts_ptr="*i32", base_ptr="*i32",
    index_ptr="*i32", index_blocks="i32", num_tokens="i32", num_experts="i32")
"""The kernel's runtime arguments and their Triton types as a bf16 GPU launch passes them."""

PTX_COUNTS = ("cp.async.bulk.tensor", "cp.async.bulk.wait_group", "fence.proxy", "bar.sync",
              "wgmma.mma_async", "st.global")

SHARED_LIMIT_BYTES = 232448
"""Shared memory one CTA may use on sm_90 (227 KiB)."""


def compile_kernel(repo: str, *, topk: int, experts_pow2: int,
                   tp: int, tma_store: bool, rotate: bool, static: bool, tma_loads: bool,
                   num_warps: int = 8, num_stages: int = 3, bm: int = 128, bn: int = 256,
                   bk: int = 64) -> dict:
    """Compile `repo`'s kernel for sm_90; returns {shared, ptx, ttgir, sass, counts,
    store_wait}. Runs in this process (the caller puts `repo` first on sys.path)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_overlap.kernels import gemm2_gatherrs as k

    here = os.path.realpath(os.path.dirname(k.__file__))
    if not here.startswith(os.path.realpath(repo) + os.sep):
        raise ValueError(f"{repo}: imported megatron_overlap from {here} instead (is it a "
                         "checkout of this repository?)")
    fn = k._gemm_scatter_kernel
    missing = [n for n in fn.arg_names if n not in KERNEL_ARGS and n not in (
        "BM", "BN", "BK", "USE_TMA", "STATIC", "USE_TIMER", "TP", "K", "EP2", "IBT", "CB",
        "TMA_STORE", "ROTATE")]
    if missing:
        raise ValueError(f"{repo}: its kernel has arguments this script does not know "
                         f"({', '.join(missing)}): another kernel signature, not comparable")
    consts = dict(BM=bm, BN=bn, BK=bk, USE_TMA=tma_loads, STATIC=static, USE_TIMER=True,
                  TP=tp, K=topk, EP2=experts_pow2, IBT=64, CB=32)
    for name, value in (("TMA_STORE", tma_store), ("ROTATE", rotate)):
        if name in fn.arg_names:  # (a checkout from before v5.2 has neither)
            consts[name] = value
        elif value:
            raise ValueError(f"{repo}: its kernel has no {name} parameter")
    if any(n not in fn.arg_names for n in KERNEL_ARGS):
        raise ValueError(f"{repo}: its kernel lacks arguments of this script's "
                         f"({', '.join(n for n in KERNEL_ARGS if n not in fn.arg_names)}): "
                         "another kernel signature, not comparable")
    signature = {n: "constexpr" if n in consts else KERNEL_ARGS[n] for n in fn.arg_names}
    aligned = [n for n, t in KERNEL_ARGS.items() if t.startswith("*")]
    aligned += ["F", "H", "stride_h", "stride_wl", "stride_wn"]  # (values: not specialised)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    lines = ttgir.splitlines()
    store_wait = "none"
    for i, line in enumerate(lines):
        if "async_tma_copy_local_to_global" in line:
            after = "\n".join(lines[i + 1: i + 2])
            store_wait = "synchronous" if "async_tma_store_wait" in after else "asynchronous"
    return dict(shared=int(compiled.metadata.shared), ptx=ptx, ttgir=ttgir,
                cubin=compiled.asm["cubin"],
                counts={p: len(re.findall(re.escape(p), ptx)) for p in PTX_COUNTS},
                store_wait=store_wait, signals_ordered=signals_after_bulk_wait(ptx),
                global_stores=global_store_widths(ptx))


def global_store_widths(ptx: str) -> dict:
    """Plain global store instructions of a PTX listing by their full opcode (e.g.
    "st.global.v4.b32", "st.global.b16"; atomics and TMA copies are not stores here), in
    the listing's static count (unrolled code counts each copy)."""
    counts: dict = {}
    for op in re.findall(r"^\s*(?:@!?%p\d+\s+)?(st\.global(?:\.[\w:]+)*)\s", ptx, re.M):
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


REDUCE_SEND_ARGS = dict(
    y_ptr="*bf16", rowy_ptr="*i32", table_ptr="*i32", peer_recv_ptrs="*i64",
    peer_sig_ptrs="*i64", sig_ptr="*i64", my_rank="i32", num_ranks="i32", num_rows="i32",
    H="i32", freed_target="i64", timeout_ns="i64", err_ptr="*i64")
"""`_reduce_send_kernel`'s runtime arguments as a bf16 GPU launch passes them."""


def compile_reduce_send(repo: str, *, topk: int, num_warps: int = 8) -> dict:
    """Compile `repo`'s pre-reduced send kernel (`_reduce_send_kernel`: the peer stores of
    the pre-reduced mode) for sm_90 as the GPU launcher runs it (its `REDUCE_SEND_BLOCK`,
    8 warps, 16-byte-aligned pointers, H divisible by 16); returns {shared, global_stores}.
    Runs in this process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_overlap.kernels import gemm2_gatherrs as k
    from megatron_overlap.ops.triton_prereduce import REDUCE_SEND_BLOCK as block

    fn = k._reduce_send_kernel
    consts = dict(K=topk, BT=block[0], BH=block[1], USE_TIMER=True)
    if sorted(n for n in fn.arg_names if n not in consts) != sorted(REDUCE_SEND_ARGS):
        raise ValueError(f"{repo}: its _reduce_send_kernel has another signature")
    signature = {n: "constexpr" if n in consts else REDUCE_SEND_ARGS[n] for n in fn.arg_names}
    aligned = [n for n, t in REDUCE_SEND_ARGS.items() if t.startswith("*")] + ["H"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps))
    return dict(shared=int(compiled.metadata.shared),
                global_stores=global_store_widths(compiled.asm["ptx"]))


def signals_after_bulk_wait(ptx: str):
    """Whether every system-scope release atomic (an arrival signal) of a kernel with TMA
    stores follows, in the PTX text, a full bulk wait (`cp.async.bulk.wait_group 0`, not
    `.read`) with no TMA store between them, then `fence.proxy.async.global`, then
    `bar.sync`: the order `_bulk_store_wait(False)` + `_signal` give. None without TMA
    stores. (Text order, not control flow: a signal whose wait was dropped fails, whichever
    loop iteration's store it should have waited for.)"""
    lines = [ln.strip() for ln in ptx.splitlines()]
    if not any("cp.async.bulk.tensor" in ln and ".global.shared" in ln for ln in lines):
        return None
    for i, line in enumerate(lines):
        if not re.search(r"\batom\.global\.sys\.release\.", line):
            continue
        seen = []  # what lies between the nearest full wait (or a store) and the signal
        for prev in reversed(lines[:i]):
            if "cp.async.bulk.tensor" in prev and ".global.shared" in prev:
                return False  # a store after the last full wait
            if re.match(r"(@%p\d+\s+)?cp\.async\.bulk\.wait_group\s+0\s*;", prev):
                break
            seen.append(prev)
        else:
            return False  # no full wait before this signal
        seen.reverse()
        fence = next((j for j, ln in enumerate(seen) if ln.startswith("fence.proxy.async.global")),
                     None)
        if fence is None or not any(ln.startswith("bar.sync") for ln in seen[fence:]):
            return False
    return True


def sass(cubin: bytes) -> str:
    """The cubin's SASS listing with addresses stripped (Triton's bundled nvdisasm)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    return re.sub(r"/\*[0-9a-f]+\*/", "", text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def _tile_shape(text: str) -> tuple:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text)
    if not m or any(v < 16 or v > 256 or v & (v - 1) for v in map(int, m.groups())):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BMxBNxBK, each a power of two "
                                         "in [16, 256]")
    return tuple(int(v) for v in m.groups())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topk", type=_positive, default=8,
                        help="top-k of the finalize index the kernel builds (default 8)")
    parser.add_argument("--experts-pow2", type=_positive, default=128,
                        help="EP2: the expert count rounded up to a power of two, 16..128 "
                             "(default 128; above 128 the kernel builds no index)")
    parser.add_argument("--tp", type=_positive, default=1)
    parser.add_argument("--tma-store", action="store_true", help="TileConfig.tma_store")
    parser.add_argument("--rotate", action="store_true", help="TileConfig.rotate")
    parser.add_argument("--dynamic", action="store_true", help="atomic tile claims")
    parser.add_argument("--pointer-loads", action="store_true",
                        help="no TMA loads (rows not 16-byte aligned)")
    parser.add_argument("--num-stages", type=_positive, default=3)
    parser.add_argument("--num-warps", type=_positive, default=8,
                        help="a power of two in [1, 32]")
    parser.add_argument("--reduce-send", action="store_true",
                        help="also compile the pre-reduced mode's send kernel "
                             "(`_reduce_send_kernel`, --topk): its global stores by width")
    parser.add_argument("--tile", type=_tile_shape, default=(128, 256, 64),
                        help="BMxBNxBK (default 128x256x64, the default tile's)")
    parser.add_argument("--out", default="", help="folder for the PTX, TTGIR and cubin")
    parser.add_argument("--compare", default="",
                        help="another checkout: compile its kernel alike and compare SASS")
    args = parser.parse_args(argv)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    e2 = args.experts_pow2
    if e2 < 16 or e2 > 128 or e2 & (e2 - 1):
        parser.error(f"--experts-pow2 {e2}: expected a power of two in [16, 128] (the "
                     "launcher's max(16, next power of two of the experts); above 128 the "
                     "GEMM2 kernel builds no finalize index)")
    if args.num_warps not in (1, 2, 4, 8, 16, 32):
        parser.error(f"--num-warps {args.num_warps}: expected a power of two in [1, 32]")
    if args.topk > e2:
        parser.error(f"--topk {args.topk}: expected at most --experts-pow2 ({e2})")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} is a file: give a folder")
    if args.compare and not os.path.isfile(os.path.join(args.compare, "megatron_overlap",
                                                        "kernels", "gemm2_gatherrs.py")):
        parser.error(f"--compare {args.compare!r}: not a checkout of this repository (no "
                     "megatron_overlap/kernels/gemm2_gatherrs.py)")
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as err:
        print(f"compile_sm90.py: Triton's CUDA backend is not importable ({err})",
              file=sys.stderr)
        return 2
    options = dict(topk=args.topk,
                   experts_pow2=args.experts_pow2, tp=args.tp, tma_store=args.tma_store,
                   rotate=args.rotate, static=not args.dynamic,
                   tma_loads=not args.pointer_loads, num_stages=args.num_stages,
                   num_warps=args.num_warps, bm=args.tile[0], bn=args.tile[1],
                   bk=args.tile[2])
    if (args.rotate or args.tma_store) and args.dynamic:
        parser.error("--rotate and --tma-store need the static schedule (no --dynamic)")
    other_sass = None
    if args.compare:
        # The other checkout first (it is the likelier to fail), in a child process: its
        # package must not mix with this one's.
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
                "sys.path.insert(0, sys.argv[2]); import compile_sm90 as c\n"
                "try:\n    r = c.compile_kernel(sys.argv[1], **json.loads(sys.argv[3]))\n"
                "except ValueError as err:\n    sys.stderr.write(str(err)); sys.exit(3)\n"
                "sys.stdout.write(c.sass(r['cubin']))")
        other = subprocess.run(
            [sys.executable, "-c", code, os.path.abspath(args.compare),
             os.path.dirname(os.path.abspath(__file__)), json.dumps(options)],
            capture_output=True, text=True)
        if other.returncode != 0:
            why = other.stderr if other.returncode == 3 else other.stderr[-3000:]
            print(f"compile_sm90.py: --compare {args.compare}: {why.strip()}", file=sys.stderr)
            return 2
        other_sass = other.stdout
    sys.path.insert(0, repo)
    try:
        result = compile_kernel(repo, **options)
    except ValueError as err:
        print(f"compile_sm90.py: {err}", file=sys.stderr)
        return 2
    summary = dict(shared_bytes=result["shared"],
                   fits_sm90=result["shared"] <= SHARED_LIMIT_BYTES,
                   tma_store_wait=result["store_wait"],
                   signals_after_bulk_wait=result["signals_ordered"],
                   ptx_counts=result["counts"], global_stores=result["global_stores"],
                   triton=__import__("triton").__version__, options=options)
    if args.reduce_send:
        try:
            summary["reduce_send"] = compile_reduce_send(repo, topk=args.topk)
        except ValueError as err:
            print(f"compile_sm90.py: {err}", file=sys.stderr)
            return 2
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for ext in ("ptx", "ttgir"):
            with open(os.path.join(args.out, f"gemm_scatter.{ext}"), "w") as f:
                f.write(result[ext])
        with open(os.path.join(args.out, "gemm_scatter.cubin"), "wb") as f:
            f.write(result["cubin"])
    if other_sass is not None:
        summary["sass_identical_to_compare"] = other_sass == sass(result["cubin"])
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
