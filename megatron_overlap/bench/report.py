"""Tables and plots of the operator benchmark's JSON rows (`launch/bench_op.py`).

    python3 -m megatron_overlap.bench.report results/bench_op.jsonl --plot bench_op.png

Row schema (one JSON object per line, one row per (workload, provider)): model,
tokens_per_rank, layout ("ep2", "tp2", ...), routing, hidden, ffn_per_rank, local_experts,
topk, rows, remote_bytes, provider ("gemm", "megatron", "prereduced", "ours", "ours_nocomm",
"bound"; "ours_prepared": the op with its host work done beforehand, as the Megatron layer
runs it, direct mode; "ours_prereduced": the same in the pre-reduced mode
(`GatherRSOptions.prereduce`; its error vs the reference in max_rel_err_prereduced_mode);
"ours_auto": whichever of the two the resource manager picks (field auto_mode: "direct" or
"prereduce"; the same runs, not timed again); "ours_e2e" / "ours_prereduced_e2e": the
two modes with their preparation timed too (uploads, table kernels, the pre-reduced mode's
routing-map all-gather; from v4.5); breakdown rows "ours_host",
"ours_prereduced_host" (host time to enqueue one call of each mode; the second from v4.6),
"ours_finalize" where present; "gemm_paired" (from v6.0: the grouped GEMM timed again in
the same interleaved rounds as "ours_nocomm" and the "nocomm[...]" rows; the table's
gemm/no-comm column is gemm_paired / ours_nocomm where it exists, else gemm / ours_nocomm,
timed apart); exploration rows
"ours[...]" / "nocomm[...]" for other tile configurations or forced CTA counts, and with
them "ours_paired" (from v6.5: ours_prepared's call timed again in the ours[<tile>] rows'
interleaved rounds)), p20_ms / p50_ms /
p80_ms (the slowest rank's), queue_ms (GPU sleep before each timed run, hiding the host's
enqueue: every provider but "ours"; absent = 0), gpu, world, peer_bandwidth_gbps, git_sha,
hw_profile (from v6.0: the hardware profile's name the plans used; before, always "h200"),
timestamp, torch.
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, List, Tuple

from megatron_overlap.bench.cli import json_rows

PROVIDERS = ("gemm", "megatron", "prereduced", "ours", "ours_nocomm", "bound")


OP_FIELDS = ("model", "tokens_per_rank", "layout", "provider", "p50_ms")
"""Fields every operator row has (`launch/bench_op.py`)."""


def load_rows(path: str) -> List[dict]:
    """The operator rows of a .jsonl file.

    Raises:
        ValueError: a line is not JSON, or a row lacks an operator-row field (e.g. layer
            or prefill rows, which `megatron_overlap.bench.make_report` reads).
    """
    rows = []
    for n, row in json_rows(path):
        missing = [k for k in OP_FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{n}: not an operator row (bench_op.py): no "
                             f"{missing}; layer / prefill rows go to "
                             "python -m megatron_overlap.bench.make_report")
        rows.append(row)
    return rows


def by_workload(rows: List[dict]) -> Dict[Tuple, Dict[str, float]]:
    """{(model, tokens_per_rank, layout): {provider: p50_ms}}, in first-seen order; a later
    run of the same workload and provider replaces an earlier one."""
    out: Dict[Tuple, Dict[str, float]] = {}
    for r in rows:
        out.setdefault((r["model"], r["tokens_per_rank"], r["layout"]), {})[r["provider"]] = (
            r["p50_ms"])
    return out


def _fmt(ms) -> str:
    return "-" if ms is None else f"{ms:.3f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def table(rows: List[dict]) -> str:
    """Markdown table: p50 times and the ratios the targets are stated in. "auto" is the op
    as the Megatron layer runs it (prepared, the resource manager's mode); rows from before
    the mode choice have no "ours_auto": their direct prepared time stands in."""
    lines = ["| model | tokens/rank | layout | gemm ms | (a) megatron ms | (b) prereduced ms | "
             "ours ms | ours no-comm ms | bound ms | (a)/ours | (b)/ours | ours/bound | "
             "gemm/no-comm | host ms | finalize ms | direct prepared ms | pre-reduced ms | "
             "auto | (a)/auto | (b)/auto | auto/bound |", "|" + "---|" * 21]
    modes = {(r["model"], r["tokens_per_rank"], r["layout"]): r.get("auto_mode", "-")
             for r in rows if r["provider"] == "ours_auto"}
    for (model, tokens, layout), g in by_workload(rows).items():
        if not all(p in g for p in PROVIDERS):
            continue
        auto = g.get("ours_auto", g.get("ours_prepared"))
        mode = modes.get((model, tokens, layout), "-")
        lines.append(
            f"| {model} | {tokens} | {layout} | {g['gemm']:.3f} | {g['megatron']:.3f} | "
            f"{g['prereduced']:.3f} | {g['ours']:.3f} | {g['ours_nocomm']:.3f} | "
            f"{g['bound']:.3f} | {g['megatron'] / g['ours']:.2f} | "
            f"{g['prereduced'] / g['ours']:.2f} | {g['ours'] / g['bound']:.2f} | "
            f"{g.get('gemm_paired', g['gemm']) / g['ours_nocomm']:.2f} | "
            f"{_fmt(g.get('ours_host'))} | "
            f"{_fmt(g.get('ours_finalize'))} | {_fmt(g.get('ours_prepared'))} | "
            f"{_fmt(g.get('ours_prereduced'))} | {mode} | "
            f"{_ratio(g['megatron'], auto)} | {_ratio(g['prereduced'], auto)} | "
            f"{_ratio(auto, g['bound'])} |")
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Bar chart: every provider's p50 over the lower bound, per workload (lower is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(k, g) for k, g in by_workload(rows).items() if all(p in g for p in PROVIDERS)]
    shown = ["megatron", "prereduced", "ours", "ours_nocomm"]
    if all("ours_prepared" in g for _, g in groups):
        shown.insert(3, "ours_prepared")
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(groups)), 4))
    width = 0.8 / len(shown)
    for i, provider in enumerate(shown):
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, [g[provider] / g["bound"] for _, g in groups], width, label=provider)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{t} {lay}" for (m, t, lay), _ in groups], rotation=60,
                       ha="right", fontsize=7)
    ax.set_ylabel("p50 time / lower bound")
    ax.set_title("GEMM2 + GatherRS operator (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Table (and plot) of bench_op JSON rows")
    parser.add_argument("jsonl")
    parser.add_argument("--plot", help="write a PNG bar chart to this .png path")
    args = parser.parse_args(argv)
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot!r}: expected a .png file path")
    try:
        rows = load_rows(args.jsonl)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    if not rows:
        parser.error(f"{args.jsonl}: no operator rows (launch/bench_op.py writes them)")
    print(table(rows))
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            parser.error(f"--plot {args.plot!r}: cannot create its folder: {err}")
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
