"""Oracle study of the resource manager: the workload suite, the k grid, regret, table, plot.

`launch/oracle.py` runs the fused op at every communication-CTA count k of a grid for every
workload of `SUITE` and writes one JSON row per (workload, k) ("grid"), one for the plan the
resource manager chose ("plan"), and `summarize` turns them into one row per workload:

    regret = (t(plan) - t(oracle)) / t(oracle),  t(oracle) = the fastest measured run
    (every grid k and the plan's own run), times = the slowest rank's median.

DESIGN.md §4 and issue 4 set the targets: mean regret <= 2 %, max <= 8 %.

The suite (16 workloads, 2 ranks; routing from `bench.workloads.routing_maps`, seed 0):
  * the five model shapes of configs/models (Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Phi-3.5-MoE,
    Qwen3-30B-A3B, DeepSeek-V2-Lite; routed experts only), each as
      EP=2, uniform routing, 4096 tokens per rank;
      EP=2, skewed routing, 4096 tokens per rank;
      TP=2, uniform routing, 8192 tokens per rank;
  * plus Qwen3-30B-A3B, EP=2, uniform, 16384 tokens per rank (the largest tile count).
  "uniform": each token's top-k of i.i.d. U(0, 1) scores over the E experts, so every expert
  is equally likely. "skewed" (the p90-style imbalance of a hot expert): the same scores,
  plus 2 on expert 0 for the first ceil(T/2) + floor(T/4) tokens of every rank, so expert 0
  is in the top-k of ~3/4 of the tokens and the rank holding it computes the most rows.
"""

from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Sequence, Tuple

MODELS = ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "phi-3.5-moe", "qwen3-30b-a3b",
          "deepseek-v2-lite")

Workload = Tuple[str, str, str, int]
"""(model, layout "ep" | "tp", routing "uniform" | "skewed", tokens per rank)."""


def suite(models: Sequence[str] = MODELS) -> List[Workload]:
    """The default workloads (see the module docstring), restricted to `models`."""
    out = []
    for m in models:
        out += [(m, "ep", "uniform", 4096), (m, "ep", "skewed", 4096), (m, "tp", "uniform", 8192)]
    if "qwen3-30b-a3b" in models:
        out.append(("qwen3-30b-a3b", "ep", "uniform", 16384))
    return out


SUITE = suite()

FIXED_K = 16
"""The fixed choice the manager replaced (resource.DEFAULT_NUM_COMM_CTAS): always measured."""


def k_grid(num_ctas: int, step: int, extra: Iterable[int] = (FIXED_K,)) -> List[int]:
    """Feasible k (1..G-1) every `step`, plus G-1 and `extra` (those within 1..G-1).

    Raises:
        ValueError: num_ctas < 2 or step < 1.
    """
    if num_ctas < 2 or step < 1:
        raise ValueError(f"num_ctas={num_ctas} (>= 2) and step={step} (>= 1) expected")
    ks = set(range(1, num_ctas, step)) | {num_ctas - 1}
    ks |= {k for k in extra if 1 <= k <= num_ctas - 1}
    return sorted(ks)


def auto_step(num_ctas: int, seconds_per_run: float, runs_per_k: int, budget_s: float) -> int:
    """Smallest k step whose grid fits `budget_s` seconds of runs for one workload."""
    if seconds_per_run <= 0 or budget_s <= 0:
        return 1
    affordable = max(2, int(budget_s / (seconds_per_run * runs_per_k)))
    return max(1, -(-(num_ctas - 1) // affordable))


def workload_key(row: dict) -> Tuple:
    return (row["model"], row["layout"], row["routing"], row["tokens_per_rank"])


def summarize(rows: Sequence[dict]) -> List[dict]:
    """One row per workload from the "grid" and "plan" rows (measured p50 in ms).

    Returns rows with: the workload fields, num_ctas, k_step, k_plan (this rank 0's),
    k_plan_ranks, k_oracle, t_plan_ms, t_oracle_ms, regret, t_fixed_ms / regret_fixed (k =
    FIXED_K when measured, else None), predicted_plan_ms, k_model_best (the grid k with the
    least predicted time).
    """
    groups: Dict[Tuple, Dict[str, list]] = {}
    for r in rows:
        groups.setdefault(workload_key(r), {"grid": [], "plan": []})[r["kind"]].append(r)
    out = []
    for key, g in groups.items():
        if not g["grid"] or not g["plan"] or g["plan"][-1].get("p50_ms") is None:
            continue
        plan = g["plan"][-1]
        grid = g["grid"]
        best = min(grid, key=lambda r: (r["p50_ms"], r["k"]))
        t_oracle = min(best["p50_ms"], plan["p50_ms"])
        k_oracle = best["k"] if best["p50_ms"] <= plan["p50_ms"] else plan["k"]
        fixed = [r for r in grid if r["k"] == FIXED_K]
        t_fixed = fixed[0]["p50_ms"] if fixed else None
        model_best = min(grid, key=lambda r: (r["predicted_ms"], r["k"]))
        out.append(dict(
            model=key[0], layout=key[1], routing=key[2], tokens_per_rank=key[3],
            # "ep2", "tp2", "tp2ep2": rows before layout_name existed were all world 2
            layout_name=plan.get("layout_name") or f"{key[1]}{plan.get('world', 2)}",
            num_ctas=plan.get("num_ctas"), k_step=plan.get("k_step"), k_plan=plan["k"],
            k_plan_ranks=plan.get("k_ranks"), k_oracle=k_oracle, t_plan_ms=plan["p50_ms"],
            t_oracle_ms=t_oracle, regret=(plan["p50_ms"] - t_oracle) / t_oracle,
            t_fixed_ms=t_fixed,
            regret_fixed=None if t_fixed is None else (t_fixed - t_oracle) / t_oracle,
            predicted_plan_ms=plan["predicted_ms"], k_model_best=model_best["k"]))
    return out


def table(summary: Sequence[dict]) -> str:
    """Markdown table of the summary, then mean / max regret."""
    lines = ["| model | layout | routing | tokens/rank | G | k step | k plan (ranks) | k oracle | "
             "plan ms | oracle ms | regret % | k=16 ms | k=16 regret % | predicted ms |",
             "|" + "---|" * 14]
    for s in summary:
        fixed = "-" if s["t_fixed_ms"] is None else f"{s['t_fixed_ms']:.3f}"
        rf = "-" if s["regret_fixed"] is None else f"{100 * s['regret_fixed']:.2f}"
        lines.append(
            f"| {s['model']} | {s['layout_name']} | {s['routing']} | {s['tokens_per_rank']} | "
            f"{s['num_ctas']} | {s['k_step']} | {s['k_plan_ranks']} | {s['k_oracle']} | "
            f"{s['t_plan_ms']:.3f} | {s['t_oracle_ms']:.3f} | {100 * s['regret']:.2f} | "
            f"{fixed} | {rf} | {s['predicted_plan_ms']:.3f} |")
    lines.append("")
    lines.append(regret_line(summary))
    return "\n".join(lines)


def regret_line(summary: Sequence[dict]) -> str:
    """"mean regret x %, max y % over n workloads" (and the fixed k's, where measured)."""
    if not summary:
        return "no measured workload"
    reg = [s["regret"] for s in summary]
    text = (f"regret of the plan: mean {100 * statistics.mean(reg):.2f} %, max "
            f"{100 * max(reg):.2f} % over {len(reg)} workloads (targets: mean <= 2 %, "
            "max <= 8 %)")
    fixed = [s["regret_fixed"] for s in summary if s["regret_fixed"] is not None]
    if fixed:
        text += (f"; fixed k={FIXED_K}: mean {100 * statistics.mean(fixed):.2f} %, max "
                 f"{100 * max(fixed):.2f} %")
    return text


def plot(rows: Sequence[dict], summary: Sequence[dict], path: str) -> None:
    """Two panels: predicted vs measured time of every (workload, k) run (one colour per
    workload, y = x dashed), and the regret of the plan (and of k = 16) per workload.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6))
    keys = list(dict.fromkeys(workload_key(r) for r in rows))
    cmap = plt.get_cmap("tab20")
    lo, hi = float("inf"), 0.0
    for i, key in enumerate(keys):
        pts = [(r["predicted_ms"], r["p50_ms"]) for r in rows
               if workload_key(r) == key and r["kind"] == "grid" and r.get("p50_ms") is not None]
        if not pts:
            continue
        x, y = zip(*pts)
        lo, hi = min(lo, *x, *y), max(hi, *x, *y)
        ax1.scatter(x, y, s=8, color=cmap(i % 20), label=f"{key[0]} {key[1]}2 {key[2]} {key[3]}")
        plans = [r for r in rows if workload_key(r) == key and r["kind"] == "plan"
                 and r.get("p50_ms") is not None]
        for r in plans:
            ax1.scatter([r["predicted_ms"]], [r["p50_ms"]], s=60, marker="*",
                        color=cmap(i % 20), edgecolors="black")
    if hi > 0:
        ax1.plot([lo, hi], [lo, hi], "k--", linewidth=1)
        ax1.set_xscale("log")
        ax1.set_yscale("log")
    ax1.set_xlabel("predicted ms (model)")
    ax1.set_ylabel("measured ms (p50, slowest rank)")
    ax1.set_title("every k of the grid (dots) and the plan (stars)")
    ax1.legend(fontsize=6, loc="upper left")
    names = [f"{s['model'][:12]} {s['layout_name']} {s['routing'][:4]} {s['tokens_per_rank']}"
             for s in summary]
    xs = range(len(summary))
    ax2.bar([x - 0.2 for x in xs], [100 * s["regret"] for s in summary], width=0.4,
            label="plan")
    ax2.bar([x + 0.2 for x in xs], [100 * (s["regret_fixed"] or 0) for s in summary],
            width=0.4, label=f"fixed k={FIXED_K}")
    ax2.axhline(2, color="green", linestyle=":", label="mean target 2 %")
    ax2.axhline(8, color="red", linestyle=":", label="max target 8 %")
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels(names, rotation=75, fontsize=6)
    ax2.set_ylabel("regret vs the measured oracle, %")
    ax2.set_title(regret_line(summary).split(" (")[0], fontsize=8)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
