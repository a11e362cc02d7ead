"""The benchmark report: tables, speedup plots, geometric means, memory, versions, commands.

    python -m megatron_overlap.bench.make_report docs/results/*.jsonl --out docs/report.md

reads the JSON rows of the layer benchmark (`launch/bench_layer.py`) and the full-model
prefill (`launch/prefill.py`), and writes a markdown report plus one PNG per benchmark next
to it (`<out stem>_layer.png`, `<out stem>_prefill.png`: t_baseline / t_on against sequence
length, one panel per model and layout). Other rows (the operator benchmark's, which have
no `schema` field) are skipped and counted; so are CPU rows (timings of a CPU run are not
benchmark numbers) unless `--include-cpu`. When several rows have the same key (benchmark,
model, layout, layers, sequence length, variant, requested backend, attention: a table
cell) the newest (`timestamp`) wins, whatever its GPU and dtype; the report warns where a
benchmark's rows mix GPUs or dtypes, or commits.

`--breakdown FILE ...` adds a section "Where the host time goes": the layer rows of a run with
`--host-breakdown` (their `host_breakdown_us`), flag on against each baseline, stage by stage
(host microseconds per forward). Those rows are used for that section only (a run with
timers on is not the grid's timing).

Speedup of the flag over a baseline = t_baseline / t_on of the p50 times (> 1: flag on is
faster). Targets (issue 5), checked and stated met or missed:
  * layer: geometric mean >= 1.3 over "off-grouped" on the fine-grained models, and no
    workload slower than any baseline;
  * full model: geometric mean >= 1.15 over "off" on the fine-grained models at sequence
    length >= 4096, and no such workload slower;
  * the flag's extra peak memory (own peak, see `megatron_overlap.bench.measure`) <= 10 % of
    the baseline's ("off"); for the breakdown the report also gives the extra peak over
    "off-grouped" (the same grouped FC1 as flag on: what the fused return path adds) and the
    symmetric receive workspace in % of off-grouped's peak (information, no verdict).

Row schema (JSON lines; one row per workload and variant)
---------------------------------------------------------
`schema` "megatron_overlap.layer/1" (layer) or "megatron_overlap.prefill/1" (full model);
`benchmark` "layer" | "prefill". A field whose meaning changes gets a new schema version.

Common fields:
  model (configs/models name), layout ("tp{T}/ep{E}/dp{D}/sp{0|1}"), world_size, tp, ep, dp,
  sequence_parallel, micro_batch_size, dtype ("bf16" | "fp32"), seq_length (tokens per
  sequence), global_tokens (tokens through the layer/model per forward, all ranks),
  variant ("on" | "off" | "off-grouped" | "off-te"; layer rows also "on-alt", the flag-on
  layer with `alt_env`, "VAR=VALUE", set around its forwards: `bench_layer.py --alt-env`,
  left out of the speedups, targets and the settings' mix check), label (exact description of the
  variant, `megatron_overlap.bench.baselines.label`), experts_impl (what its experts ran:
  grouped GEMM implementation or loop, FC2 weight view or stack), moe_gatherrs_overlap
  (bool), backend_requested, backend ("triton" | "reference" for "on", "megatron-alltoall"
  otherwise), fused_calls (fused-op launches in the timed forwards; 0 for baselines),
  combine_mode (layer) / combine_modes (prefill; a list over the MoE layers): what the
  flag-on variant's last combine ran, "direct" | "prereduced" | "reference" (absent in
  rows from before v4.4), prereduce (the run's setting: true | false | "auto"), fc1_impl
  (the flag-on experts' FC1 setting, "auto" | "grouped" | "loop"; absent before v4.7),
  bias_activation_fusion (the run's `--bias-activation-fusion`, every variant; absent
  in rows from before 6a8f863, v4.8's layer grid among them), fc1_chunk_bytes (the
  grouped FC1's chunk, `MEGATRON_OVERLAP_FC1_CHUNK_MB`: from 7055ab9 (v4.8) bytes of a
  group of whole experts' [rows, 2F] FC1 output, default 512 MiB; from d332b27 (v4.9)
  bytes of a chunk of rows of that output; from c3a54e9 (default 128 MiB) bytes of a
  chunk of [rows, F] of the split SwiGLU's linear half, and from 55b2e2f on every path;
  absent in rows from before 7055ab9), resource_solver (the resource manager's solver
  in that process, "cpp" | "python", `resource.solver.implementation_name`; absent
  before v4.9's eed19ee), tma_store (from v5.9: whether the flag-on GEMM2's default tile
  stores through TMA descriptors for the row's TP x EP group, false where the flag-on
  variant runs no GPU kernel; v5.2-v5.8: the run's `MEGATRON_OVERLAP_TMA_STORE`, in every
  row of the run; absent before v5.2), tma_store_env (from v5.9: the run's
  `MEGATRON_OVERLAP_TMA_STORE` as set, "" unset), tile_choice / tile_choice_env (from
  v6.1: whether the resource manager picked the flag-on GEMM2's tile per call for the row's
  TP x EP group, false where no GPU kernel runs; `MEGATRON_OVERLAP_TILE_CHOICE` as set, ""
  unset), gemm2_tile (layer, from v6.1: the tile the flag-on variant's last Triton combine
  ran, `TileConfig.name`, e.g. "128x256x64w8s3tma"; None for baselines and the reference
  backend) / gemm2_tiles (prefill: the same over the MoE layers, a sorted list), tile_list /
  host_tables / fast_launch (the run's `MEGATRON_OVERLAP_TILE_LIST` / `_HOST_TABLES` /
  `_FAST_LAUNCH`, effective values; absent before v5.4), host_cache (the run's
  `MEGATRON_OVERLAP_HOST_CACHE`, effective: bool; absent before v5.5), host_splits (the
  run's `MEGATRON_OVERLAP_HOST_SPLITS`, effective: bool; absent before v5.7), hw_profile
  (the `name` of the hardware profile the flag-on plans used, "" where the flag-on variant
  runs no GPU kernel; absent before v6.0, when it was always "h200"), timing_order
  (the variants' order in the timed rounds: "williams", `bench.measure.round_order`, from
  v5.4; absent before, when bench_layer rotated the order every round and prefill kept
  off, on, off-grouped, so every variant had the same predecessor in every round),
  warmup, iters, ms_p20 / ms_p50 / ms_p80 / ms_mean (ms per forward, the slowest rank's),
  ms_all (every timed forward, slowest rank), tokens_per_s (global_tokens / p50),
  host_ms_p50 (layer from v4.5, prefill from v5.1: p50 of the host time to run and enqueue a
  forward, its waits in host syncs included, slowest rank;
  host_breakdown_us: {stage: host us per forward} with `--host-breakdown` (layer; prefill
  from v5.8, its stages summed over the model's layers: `bench.breakdown`; `--breakdown`
  tabulates layer rows only), else None;
  from v4.7 each stage's median over the forwards, plus "python.gc", the mean time per
  forward of Python's garbage collector; before, each stage's mean),
  speedup_over_on (t_variant / t_on, p50), memory in bytes per rank (max over ranks; None on
  CPU): param_bytes, symm_workspace_bytes, fwd_extra_bytes, own_peak_bytes (their sum),
  peak_abs_bytes, persistent_bytes (information only), peak_mem_gib (layer: own peak in GiB;
  prefill: absolute max_memory_allocated in GiB, both models resident), errors (agreement
  measures against "off"), max_rel_diff, tolerance, criterion (the rule, in words), agree,
  seed, command (the launch command, reconstructed), environment: gpu, host, python, torch,
  cuda, triton, megatron_core, megatron_overlap, transformer_engine (None if absent),
  grouped_mm (torch's grouped GEMM or "loop"), git_sha, timestamp (UTC ISO 8601).
Layer only: tokens_per_rank, hidden_size, moe_ffn_hidden_size, num_moe_experts,
  moe_router_topk, local_experts, shared_expert_size, variants, skipped_baselines
  ({variant: reason}), l2_flush; errors = max_error of the layer output vs "off"
  (max_abs_diff, max_abs_ref, max_rel_diff, nonfinite).
Prefill only: num_layers, num_dense_layers, fused_moe_layers, attention ("local" | "sdpa"),
  reference ("fp32" | "none ..."), variants, speedup_off_over_on (t_off / t_on); errors =
  {moe1_on_vs_off, on_vs_off, off_vs_ref, on_vs_ref} of the row's variant ("off" rows carry
  the flag-on variant's) as in `launch/prefill.py` `check_seq`.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_overlap.bench.cli import json_rows

SCHEMAS = {"megatron_overlap.layer/1": "layer", "megatron_overlap.prefill/1": "prefill"}
FINE_GRAINED = ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "deepseek-v2-lite")
"""The target group of the issue: many small experts (more communication per FLOP)."""
COARSE = ("mixtral-8x7b", "phi-3.5-moe")
MODEL_ORDER = FINE_GRAINED + COARSE
BASELINE_ORDER = ("off", "off-grouped", "off-te")
TARGETS = {
    "layer": {"baseline": "off-grouped", "geomean": 1.3, "min_seq": 0},
    "prefill": {"baseline": "off", "geomean": 1.15, "min_seq": 4096},
}
MEMORY_TARGET = 0.10
"""Largest accepted (own_peak(on) - own_peak(off)) / own_peak(off)."""

_KEY_FIELDS = ("benchmark", "model", "layout", "num_layers", "seq_length", "variant",
               "backend_requested", "attention")
"""A table cell's identity: of rows with the same values the newest is kept (so a row of
another GPU or dtype replaces an older one of the same workload and variant, and
`environment_section` warns where a benchmark's rows mix GPUs or dtypes)."""


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------


def load_rows(paths: Iterable[str]) -> tuple[list[dict], dict]:
    """Every JSON row of the files, and counts of what was skipped.

    Returns:
        (rows of a known schema, {"foreign": rows of other schemas, "files": files read}).

    Raises:
        ValueError: a file is missing or not a regular file, a line is not JSON, or a row of
            a known schema lacks a field the report reads or has a value of the wrong kind
            (names file, line, field and value: `check_row`).
    """
    rows, foreign, files = [], 0, 0
    for path in paths:
        file = Path(path)
        if not file.exists():
            raise ValueError(f"{path}: no such file")
        if not file.is_file():
            raise ValueError(f"{path}: not a regular file (a .jsonl file of rows)")
        files += 1
        try:
            lines = list(json_rows(path))
        except OSError as err:
            raise ValueError(f"{path}: cannot read it ({err.strerror})") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}): "
                             "expected a .jsonl file of rows") from None
        for number, row in lines:
            if isinstance(row, dict) and row.get("schema") in SCHEMAS:
                row.setdefault("benchmark", SCHEMAS[row["schema"]])
                check_row(row, f"{path}:{number}")
                rows.append(row)
            else:
                foreign += 1
    return rows, {"foreign": foreign, "files": files}


def _finite_positive(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def check_row(row: dict, where: str) -> None:
    """Check the fields of a layer / prefill row that the report reads.

    Raises:
        ValueError: "WHERE: FIELD=VALUE, expected ...": model, layout, variant and
            benchmark must be non-empty strings, seq_length an int >= 1, ms_p50 a finite
            number > 0, own_peak_bytes None or an int >= 0, agree a bool when present.
    """
    def bad(field, expected):
        raise ValueError(f"{where}: {field}={row.get(field, '<missing>')!r}, expected "
                         f"{expected}")

    for field in ("model", "layout", "variant", "benchmark"):
        if not isinstance(row.get(field), str) or not row[field]:
            bad(field, "a non-empty string")
    seq = row.get("seq_length")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        bad("seq_length", "an int >= 1")
    if not _finite_positive(row.get("ms_p50")):
        bad("ms_p50", "a finite number of milliseconds > 0")
    own = row.get("own_peak_bytes")
    if own is not None and (isinstance(own, bool) or not isinstance(own, int) or own < 0):
        bad("own_peak_bytes", "null or an int >= 0")
    if "agree" in row and not isinstance(row["agree"], bool):
        bad("agree", "true or false")


def select_rows(rows: list[dict], *, include_cpu: bool = False) -> tuple[list[dict], dict]:
    """Drop CPU rows (unless asked) and keep the newest row per key.

    Returns:
        (rows, {"cpu": dropped CPU rows, "superseded": older duplicates dropped}).
    """
    kept, cpu = {}, 0
    for row in rows:
        if row.get("gpu") == "cpu" and not include_cpu:
            cpu += 1
            continue
        key = tuple(row.get(field) for field in _KEY_FIELDS)
        if key not in kept or str(row.get("timestamp", "")) >= str(kept[key].get("timestamp", "")):
            kept[key] = row
    return list(kept.values()), {"cpu": cpu, "superseded": len(rows) - cpu - len(kept)}


def _model_rank(model: str) -> tuple:
    return (MODEL_ORDER.index(model), "") if model in MODEL_ORDER else (len(MODEL_ORDER), model)


def workloads(rows: list[dict], benchmark: str) -> dict:
    """{(model, layout, num_layers, seq_length, backend_requested): {variant: row}} of one
    benchmark (num_layers None for the layer benchmark), sorted by model (fine-grained
    first), layout, layers, sequence length and requested backend. Runs that asked for
    different fused backends are different workloads."""
    out: dict = {}
    for row in rows:
        if row["benchmark"] != benchmark:
            continue
        key = (row["model"], row["layout"], row.get("num_layers"), row["seq_length"],
               str(row.get("backend_requested", "-")))
        out.setdefault(key, {})[row["variant"]] = row
    return dict(sorted(out.items(), key=lambda kv: (_model_rank(kv[0][0]), kv[0][1],
                                                   kv[0][2] or 0, kv[0][3], kv[0][4])))


def missing_workloads(groups: dict) -> list[str]:
    """The (model, layout, sequence length) points of the grid the rows span (every model,
    layout and sequence length seen in this benchmark, crossed) that have no row, one line
    per (model, layout): a cut or partial run says so in the report instead of silently
    shrinking the geomeans."""
    have = {(k[0], k[1], k[3]) for k in groups}
    models = sorted({k[0] for k in have}, key=_model_rank)
    layouts = sorted({k[1] for k in have})
    seqs = sorted({k[2] for k in have})
    lines = []
    for model in models:
        for layout in layouts:
            gone = [q for q in seqs if (model, layout, q) not in have]
            if gone:
                what = ("every sequence length" if len(gone) == len(seqs)
                        else "seq " + ", ".join(str(q) for q in gone))
                lines.append(f"* {model}, {layout}: {what}")
    return lines


def speedup(group: dict, baseline: str) -> float | None:
    """t_baseline / t_on (p50) of one workload, None when either is missing."""
    if "on" not in group or baseline not in group:
        return None
    return group[baseline]["ms_p50"] / group["on"]["ms_p50"]


def memory_extra(group: dict, baseline: str = "off") -> float | None:
    """own_peak(on) / own_peak(baseline) - 1, None without both."""
    on, base = group.get("on", {}).get("own_peak_bytes"), group.get(baseline, {}).get(
        "own_peak_bytes")
    if not on or not base:
        return None
    return on / base - 1.0


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive numbers, None for none.

    Raises:
        ValueError: a value <= 0.
    """
    if not values:
        return None
    if any(v <= 0 for v in values):
        raise ValueError(f"geometric mean of non-positive values: {values}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def group_of(model: str) -> str:
    """"fine-grained", "coarse" (Mixtral, Phi-3.5-MoE) or "other"."""
    if model in FINE_GRAINED:
        return "fine-grained"
    return "coarse" if model in COARSE else "other"


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _gib(value) -> str:
    return "-" if not value else f"{value / 2**30:.2f}"


def _table(header: Sequence[str], lines: Iterable[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def baselines_present(groups: dict) -> list[str]:
    """Baselines that appear in any workload, in `BASELINE_ORDER`."""
    seen = {v for g in groups.values() for v in g}
    return [b for b in BASELINE_ORDER if b in seen]


def workload_table(groups: dict, benchmark: str) -> str:
    """One line per workload: p50 of each variant, speedups, memory, agreement."""
    bases = baselines_present(groups)
    header = ["model", "layout"] + (["layers"] if benchmark == "prefill" else []) + [
        "seq", "ms on"]
    header += [f"ms {b}" for b in bases] + [f"{b} / on" for b in bases]
    header += ["own peak GiB on / off", "extra mem vs off", "agree",
               "backend, combine mode (requested backend)"]
    lines = []
    for (model, layout, layers, seq, backend), g in groups.items():
        on = g.get("on")
        any_row = next(iter(g.values()))
        moe = any_row.get("fused_moe_layers")
        layer_text = f"{layers} ({moe} MoE)" if moe is not None else str(layers)
        cells = [model, layout] + ([layer_text] if benchmark == "prefill" else [])
        cells += [str(seq), _fmt(on["ms_p50"] if on else None, ".3f")]
        cells += [_fmt(g[b]["ms_p50"] if b in g else None, ".3f") for b in bases]
        cells += [_fmt(speedup(g, b), ".3f") for b in bases]
        cells.append(f"{_gib(on and on.get('own_peak_bytes'))} / "
                     f"{_gib(g.get('off', {}).get('own_peak_bytes'))}")
        cells.append(_fmt(memory_extra(g), "+.1%"))
        agree = all(r.get("agree", False) for r in g.values())
        cells.append("yes" if agree else "NO")
        ran = "-"
        if on:  # the combine mode(s) the flag-on variant ran, where the rows say
            modes = on.get("combine_modes") or ([on["combine_mode"]]
                                                if on.get("combine_mode") else [])
            ran = on["backend"] + "".join(f", {m}" for m in modes if m != "reference")
        cells.append(f"{ran} ({backend})")
        lines.append(cells)
    return _table(header, lines)


def geomean_table(groups: dict, benchmark: str) -> str:
    """Geometric mean, minimum and count of t_baseline / t_on per target group, layout and
    baseline (prefill: sequence length >= 4096 only, as the targets are stated)."""
    min_seq = TARGETS[benchmark]["min_seq"]
    bases = baselines_present(groups)
    header = ["group", "layout", "baseline", "workloads", "geomean t_base / t_on", "min",
              "slower workloads"]
    layouts = sorted({k[1] for k in groups})
    lines = []
    for group in ("fine-grained", "coarse", "other", "all"):
        for layout in layouts + ["all"]:
            for base in bases:
                values = [
                    s for (model, lay, _, seq, _), g in groups.items()
                    if (group == "all" or group_of(model) == group)
                    and (layout == "all" or lay == layout) and seq >= min_seq
                    and (s := speedup(g, base)) is not None
                ]
                if not values:
                    continue
                lines.append([group, layout, base, str(len(values)),
                              _fmt(geomean(values), ".3f"), _fmt(min(values), ".3f"),
                              str(sum(v < 1.0 for v in values))])
    return _table(header, lines)


def target_lines(groups: dict, benchmark: str) -> list[str]:
    """Each target of `benchmark`, its measured value and "met" / "MISSED" / "not measured"."""
    target = TARGETS[benchmark]
    base, min_seq = target["baseline"], target["min_seq"]
    seq_note = f" at seq >= {min_seq}" if min_seq else ""
    fine = [s for (m, _, _, seq, _), g in groups.items()
            if m in FINE_GRAINED and seq >= min_seq and (s := speedup(g, base)) is not None]
    gm = geomean(fine)
    lines = []
    if gm is None:
        lines.append(f"* geomean over `{base}`, fine-grained models{seq_note}: not measured")
    else:
        verdict = "met" if gm >= target["geomean"] else "MISSED"
        lines.append(f"* geomean over `{base}`, fine-grained models{seq_note}, all layouts: "
                     f"**{gm:.3f}x** (target >= {target['geomean']}x): **{verdict}**")
    every = [(s, m, lay, seq, b) for (m, lay, _, seq, _), g in groups.items() if seq >= min_seq
             for b in BASELINE_ORDER if (s := speedup(g, b)) is not None]
    if not every:
        lines.append(f"* never slower than a baseline{seq_note}: not measured")
    else:
        worst = min(every)
        slower = sum(s < 1.0 for s, *_ in every)
        verdict = "met" if slower == 0 else "MISSED"
        lines.append(
            f"* never slower than any baseline{seq_note}: {slower} of {len(every)} "
            f"(workload, baseline) pairs slower; worst {worst[0]:.3f}x ({worst[1]}, "
            f"{worst[2]}, seq {worst[3]}, vs {worst[4]}): **{verdict}**")
    extras = [(e, m, lay, seq) for (m, lay, _, seq, _), g in groups.items()
              if (e := memory_extra(g)) is not None]
    if not extras:
        lines.append("* extra peak memory <= 10 % of `off`'s: not measured")
    else:
        worst = max(extras)
        verdict = "met" if worst[0] <= MEMORY_TARGET else "MISSED"
        lines.append(f"* extra peak memory vs `off` (own peak): at most **{worst[0]:+.1%}** "
                     f"({worst[1]}, {worst[2]}, seq {worst[3]}; target <= "
                     f"{MEMORY_TARGET:.0%}): **{verdict}**")
    grouped = [(e, m, lay, seq, g) for (m, lay, _, seq, _), g in groups.items()
               if (e := memory_extra(g, "off-grouped")) is not None]
    if grouped:
        # Information, not a target: off-grouped runs the same grouped FC1 as flag on, so
        # the difference is what the fused return path itself adds.
        worst = max(grouped, key=lambda x: x[0])
        symm = worst[4]["on"].get("symm_workspace_bytes")
        share = (f"; the flag-on symmetric receive workspace alone is "
                 f"{symm / worst[4]['off-grouped']['own_peak_bytes']:.1%} of `off-grouped`'s "
                 "peak there" if symm else "")
        lines.append(f"  * breakdown: vs `off-grouped` (the same grouped FC1 as flag on, so "
                     f"the difference is the fused return path's) at most "
                     f"**{worst[0]:+.1%}** ({worst[1]}, {worst[2]}, seq {worst[3]}{share})")
    return lines


def slower_table(groups: dict, benchmark: str) -> str | None:
    """Every (workload, baseline) pair where flag on is slower (prefill: sequence length
    >= 4096, as the target), with both variants' times and, where the rows have it
    (`host_ms_p50`, layer rows from v4.5 on), both host times per forward and the two
    differences: when flag on's extra host time is about its extra time and both host times
    are close to their forward times, the host paces the pair and the loss is host work.
    None when no pair is slower."""
    min_seq = TARGETS[benchmark]["min_seq"]
    lines = []
    for (model, layout, _, seq, _), g in groups.items():
        if seq < min_seq:
            continue
        for base in BASELINE_ORDER:
            s = speedup(g, base)
            if s is None or s >= 1.0:
                continue
            on, off = g["on"], g[base]
            h_on, h_off = on.get("host_ms_p50"), off.get("host_ms_p50")
            both = h_on is not None and h_off is not None
            lines.append([model, layout, str(seq), f"`{base}`", f"{s:.3f}",
                          _fmt(on["ms_p50"], ".3f"), _fmt(off["ms_p50"], ".3f"),
                          _fmt(h_on, ".3f"), _fmt(h_off, ".3f"),
                          _fmt(on["ms_p50"] - off["ms_p50"], "+.3f"),
                          _fmt(h_on - h_off if both else None, "+.3f")])
    if not lines:
        return None
    return _table(["model", "layout", "seq", "baseline", "t_base / t_on", "ms on",
                   "ms base", "host ms on", "host ms base", "ms on - base",
                   "host ms on - base"], lines)


TOP_STAGES = ("layer.route", "layer.preprocess", "layer.dispatch",
              "layer.routed_experts_compute", "layer.combine", "layer.postprocess")
"""The host timers of `MoELayer.forward`'s own stages (`launch/bench_layer.py
--host-breakdown`), which run one after another inside "forward"."""

INNER_STAGES = (
    "token_dispatcher.dispatch_preprocess", "mo.counts_all_gather",
    "token_dispatcher.token_dispatch", "token_dispatcher.dispatch_postprocess",
    "mo.dispatch_postprocess", "mo.counts_to_host", "mo.build_metadata", "mo.fc1",
    "experts.forward_fc1", "experts.forward", "token_dispatcher.prepare_combine", "mo.plan",
    "mo.routing_maps", "mo.prepare", "mo.direct_layout", "mo.h2d", "mo.prepare_kernels",
    "token_dispatcher.combine_send", "mo.gemm2_gatherrs", "mo.send",
    "token_dispatcher.combine_finish", "mo.finalize", "token_dispatcher.combine_preprocess",
    "token_dispatcher.token_combine", "token_dispatcher.combine_postprocess", "python.gc")
"""Timers inside those stages, in the order a forward meets them (others follow, by name):
Megatron's dispatcher and experts, and the flag-on path's `mo.*`, one inside another (e.g.
`mo.plan` and `mo.prepare` inside `token_dispatcher.prepare_combine`; `mo.gemm2_gatherrs`
counts both halves of the combine)."""

_BREAKDOWN_KEY = ("model", "layout", "seq_length", "dtype", "gpu", "backend_requested")


def check_breakdown_row(row: dict, where: str) -> None:
    """A row given to `--breakdown`: `host_breakdown_us` a non-empty {stage: finite us >= 0}
    and `host_ms_p50` null or a finite number > 0.

    Raises:
        ValueError: "WHERE: FIELD=VALUE, expected ..."."""
    us = row.get("host_breakdown_us")
    if not isinstance(us, dict) or not us:
        raise ValueError(f"{where}: host_breakdown_us={us!r}, expected a non-empty "
                         "{stage: microseconds} (a bench_layer.py --host-breakdown row)")
    for stage, value in us.items():
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0):
            raise ValueError(f"{where}: host_breakdown_us[{stage!r}]={value!r}, expected a "
                             "finite number of microseconds >= 0")
    host = row.get("host_ms_p50")
    if host is not None and not _finite_positive(host):
        raise ValueError(f"{where}: host_ms_p50={host!r}, expected null or a finite number "
                         "of milliseconds > 0")


def breakdown_workloads(rows: list[dict]) -> tuple[dict, list[str]]:
    """Group layer rows with a host breakdown by workload (model, layout, sequence length,
    dtype, GPU, requested backend; the newest row per variant wins).

    Returns:
        ({key: {variant: row}} of the workloads where flag on and at least one baseline
        have a breakdown, in model order), [a line per workload left out, saying why].
    """
    groups: dict = {}
    for row in sorted(rows, key=lambda r: str(r.get("timestamp", ""))):
        if row.get("benchmark") == "layer" and isinstance(row.get("host_breakdown_us"), dict):
            key = tuple(row.get(f) for f in _BREAKDOWN_KEY)
            groups.setdefault(key, {})[row["variant"]] = row
    kept, dropped = {}, []
    for key in sorted(groups, key=lambda k: (_model_rank(k[0]), k[1], k[2], str(k[3:]))):
        variants = groups[key]
        if "on" in variants and any(b in variants for b in BASELINE_ORDER):
            kept[key] = variants
        else:
            dropped.append(f"{key[0]} {key[1]} seq {key[2]}: breakdowns of "
                           f"{sorted(variants)} only (needs `on` and a baseline)")
    return kept, dropped


def breakdown_table(variants: dict) -> str:
    """One workload's host time per stage (us per forward): flag on, each baseline, and on
    minus the baseline where both have the stage ("-" where one lacks it); "forward" and
    `TOP_STAGES` first, then "forward" less their sum, then the timers inside them.
    Stages that no variant has are left out."""
    bases = [b for b in BASELINE_ORDER if b in variants]
    names = ["on"] + bases
    us = {v: variants[v]["host_breakdown_us"] for v in names}

    def diff(a, b):
        return None if a is None or b is None else a - b

    def cells(values: dict):
        return ([_fmt(values[v], ".0f") for v in names]
                + [_fmt(diff(values["on"], values[b]), "+.0f") for b in bases])

    lines = []
    for stage in ("forward",) + TOP_STAGES:
        if any(stage in us[v] for v in names):
            lines.append([f"`{stage}`"] + cells({v: us[v].get(stage) for v in names}))
    rest = {v: (us[v]["forward"] - sum(us[v].get(t, 0.0) for t in TOP_STAGES)
                if "forward" in us[v] else None) for v in names}
    if any(x is not None for x in rest.values()):
        lines.append(["`forward` less the stages above (approximate: each value is a "
                      "median over forwards and a maximum over ranks, which do not add)"]
                     + cells(rest))
    known = set(("forward",) + TOP_STAGES)
    inner = [t for t in INNER_STAGES if any(t in us[v] for v in names)]
    other = sorted({t for v in names for t in us[v]} - known - set(inner))
    for stage in inner + other:
        lines.append([f"&nbsp;&nbsp;`{stage}`"] + cells({v: us[v].get(stage) for v in names}))
    header = (["host us per forward"] + [f"`{v}`" for v in names]
              + [f"on - `{b}`" for b in bases])
    return _table(header, lines)


def breakdown_section(rows: list[dict]) -> str | None:
    """The text of the "Where the host time goes" section from rows with a host breakdown,
    or None when no workload has one for flag on and a baseline."""
    groups, dropped = breakdown_workloads(rows)
    if not groups:
        return None
    parts = ["Host microseconds per forward in each stage (`launch/bench_layer.py "
             "--host-breakdown`: each stage's median over the run's forwards, the maximum "
             "over ranks stage by stage), from a run of its own: another draw of the host than "
             "the tables above, and its stage timers add host time of their own. Where the "
             "host paces a forward (host ms close to ms), a stage's extra host time is extra "
             "time."]
    for key, variants in groups.items():
        model, layout, seq = key[:3]
        names = ["on"] + [b for b in BASELINE_ORDER if b in variants]
        times = ", ".join(f"`{v}` {variants[v]['ms_p50']:.3f} ms (host "
                          f"{_fmt(variants[v].get('host_ms_p50'), '.3f')})" for v in names)
        extra = ", ".join(f"{f} {key[i]}" for i, f in enumerate(_BREAKDOWN_KEY)
                          if i >= 3 and key[i] is not None)
        parts += ["", f"**{model} {layout} seq {seq}** ({extra}): p50 {times}.", "",
                  breakdown_table(variants)]
    if dropped:
        parts += ["", "Left out:", ""] + [f"* {line}" for line in dropped]
    return "\n".join(parts)


def labels_section(rows: list[dict]) -> str:
    """Every distinct (benchmark, variant, label, experts_impl), and skipped baselines."""
    seen, lines = set(), []
    for row in rows:
        key = (row["benchmark"], row["variant"], row.get("label") or "-",
               row.get("experts_impl") or "-")
        if key not in seen:
            seen.add(key)
            lines.append([f"`{k}`" if i < 2 else k for i, k in enumerate(key)])
    lines.sort()
    text = _table(["benchmark", "variant", "label", "experts ran"], lines)
    skipped = {(v, r) for row in rows for v, r in (row.get("skipped_baselines") or {}).items()}
    for variant, reason in sorted(skipped):
        text += f"\n\n`{variant}` was not run: {reason}."
    return text


def environment_section(rows: list[dict]) -> str:
    """Distinct hardware/software combinations of the rows, with their time span; a note
    for a benchmark whose rows come from several commits (`git_sha`, "unknown" left out),
    a warning for one whose rows come from several GPUs or dtypes."""
    fields = ("gpu", "world_size", "python", "torch", "cuda", "triton", "megatron_core",
              "megatron_overlap", "transformer_engine", "grouped_mm", "git_sha")
    combos: dict = {}
    for row in rows:
        key = tuple("-" if row.get(f) is None else str(row.get(f)) for f in fields)
        stamps = combos.setdefault(key, [])
        stamps.append(str(row.get("timestamp", "")))
    lines = [list(key) + [f"{min(st)} .. {max(st)}", str(len(st))] for key, st in combos.items()]
    text = _table(list(fields) + ["timestamps (UTC)", "rows"], lines)
    commits: dict = {}
    for row in rows:
        if row.get("git_sha") and row["git_sha"] != "unknown":
            commits.setdefault(row["benchmark"], set()).add(str(row["git_sha"]))
    for benchmark, shas in sorted(commits.items()):
        if len(shas) > 1:
            text += (f"\n\n**Note:** the {benchmark} rows come from {len(shas)} commits ("
                     + ", ".join(sorted(shas)) + "): its tables compare code versions as "
                     "well as workloads.")
    for field, what in (("gpu", "GPUs (or the CPU)"), ("dtype", "dtypes")):
        per_benchmark: dict = {}
        for row in rows:
            per_benchmark.setdefault(row["benchmark"], set()).add(str(row.get(field, "-")))
        for benchmark, values in sorted(per_benchmark.items()):
            if len(values) > 1:
                text += (f"\n\n**Warning:** the {benchmark} rows come from several {what} ("
                         + ", ".join(sorted(values)) + "): a speedup may divide one's time "
                         "by another's.")
    return text


SETTING_FIELDS = ("prereduce", "fc1_impl", "bias_activation_fusion", "fc1_chunk_bytes",
                  "tma_store", "tile_choice", "tile_list", "host_tables", "fast_launch",
                  "host_cache", "host_splits", "hw_profile", "timing_order")
"""Row fields of a run's settings that change what the variants compute or how fast (absent
in older rows: shown as "-"). "tma_store" shows the variable as the run set it
(`tma_store_env`: "unset", "0", "1"; rows from before v5.9 have only `tma_store`, which
then was that variable's value): the epilogue itself (`tma_store`) depends on the layout's
group size since v5.9, so it would split one run's rows. "tile_choice" likewise shows
`tile_choice_env` (`MEGATRON_OVERLAP_TILE_CHOICE`: "unset", "0", "1", "all"; "-" in rows from
before v6.1, which always ran the default tile)."""


def _setting(row: dict, field: str) -> str:
    """A row's `SETTING_FIELDS` value as the settings table shows it."""
    if field == "tma_store" and "tma_store_env" in row:
        return row["tma_store_env"] or "unset"
    if field == "tile_choice":
        return "-" if "tile_choice_env" not in row else row["tile_choice_env"] or "unset"
    value = row.get(field)
    return "-" if value is None else str(value).lower()


def settings_section(rows: list[dict]) -> str:
    """The runs' settings (`SETTING_FIELDS`) per benchmark with their row counts, and a
    warning for a benchmark whose rows mix settings (its tables then compare workloads
    measured under different settings). "on-alt" rows (`--alt-env`: their own settings by
    design, in no table) are left out and counted below the table."""
    alt = sum(1 for row in rows if row.get("variant") == "on-alt")
    rows = [row for row in rows if row.get("variant") != "on-alt"]
    combos = Counter((row["benchmark"],) + tuple(_setting(row, f) for f in SETTING_FIELDS)
                     for row in rows)
    lines = [list(key) + [str(n)] for key, n in sorted(combos.items())]
    text = _table(["benchmark", *SETTING_FIELDS, "rows"], lines)
    if alt:
        text += (f"\n\n({alt} 'on-alt' rows, `--alt-env` A/Bs with their own settings, are "
                 "left out of this table.)")
    untimed = sorted({row["benchmark"] for row in rows if row.get("timing_order") is None})
    if untimed:
        text += ("\n\n**Note:** the " + " and ".join(untimed) + " rows predate v5.4's "
                 "balanced timing order (no `timing_order`): every variant then had the same "
                 "predecessor in every round (layer: `off-grouped` right after `on`, `on` "
                 "right after `off`; prefill: off, on, off-grouped), which favours "
                 "`off-grouped` where the host paces the forward (measured for the layer "
                 "at EP1 4096 on one H200: 0.2-0.5 ms per forward; for prefill, where each "
                 "layer follows the same model's previous one, smaller and not measured; "
                 "docs/perf_notes.md v5.4).")
    settings_per_benchmark = Counter(key[0] for key in combos)
    for benchmark in sorted(b for b, n in settings_per_benchmark.items() if n > 1):
        text += (f"\n\n**Warning:** the {benchmark} rows mix settings: its tables compare "
                 "workloads measured under different settings.")
    return text


def commands_section(rows: list[dict], paths: Sequence[str], out: str,
                     breakdown_paths: Sequence[str] = (),
                     breakdown_rows: Sequence[dict] = (), flags: Sequence[str] = ()) -> str:
    """The launch commands recorded in the rows (the breakdown rows' too), and the command
    that made this report (`flags`: its switches, e.g. "--include-cpu", "--no-plots")."""
    commands = sorted({row["command"] for row in list(rows) + list(breakdown_rows)
                       if row.get("command")})
    text = "Benchmarks (as recorded in the rows; each after `source scripts/device_setup.sh`):\n\n"
    text += "```\n" + ("\n".join(commands) if commands else "(rows predate command recording)")
    text += "\n```\n\nThis report:\n\n```\npython -m megatron_overlap.bench.make_report "
    text += " ".join(shlex.quote(p) for p in paths)
    if breakdown_paths:
        text += " --breakdown " + " ".join(shlex.quote(p) for p in breakdown_paths)
    text += f" --out {shlex.quote(out)}" + "".join(f" {f}" for f in flags) + "\n```"
    return text


def disagreements(rows: list[dict]) -> list[str]:
    """One line per row whose variant did not agree with "off"."""
    return [f"* {r['benchmark']} {r['model']} {r['layout']} seq {r['seq_length']} "
            f"{r['variant']}: {r.get('criterion', '')}; errors {json.dumps(r.get('errors'))}"
            for r in rows if not r.get("agree", False)]


def render(rows: list[dict], notes: dict, paths: Sequence[str], out: str,
           plots: dict, breakdown_rows: Sequence[dict] = (),
           breakdown_paths: Sequence[str] = (), flags: Sequence[str] = ()) -> str:
    """The whole report as markdown.

    Args:
        rows: selected rows (`select_rows`).
        notes: skip counts from `load_rows` and `select_rows`.
        paths, out: the input files and the report path (for the regeneration command).
        plots: {benchmark: PNG file name relative to the report, or None}.
        breakdown_rows, breakdown_paths: rows with host breakdowns (`--breakdown`) and
            their files; their section follows the layer's tables.
        flags: the report command's switches (`--include-cpu`, `--no-plots`), for the
            regeneration command.
    """
    parts = ["# Benchmark report: MoE layer and full-model prefill, flag on vs off", ""]
    parts.append(
        f"Generated by `megatron_overlap.bench.make_report` from {notes['files']} file(s): "
        f"{len(rows)} rows used; skipped {notes['foreign']} rows of other benchmarks, "
        f"{notes['cpu']} CPU rows, {notes['superseded']} older duplicates. Speedup = "
        "t_baseline / t_on of p50 times (> 1: the flag is faster); every time is the slowest "
        "rank's. Memory = own peak per rank (parameters + symmetric workspace + largest "
        "forward transient; `megatron_overlap.bench.measure`). Tables and targets: "
        "`megatron_overlap/bench/make_report.py`; where time goes inside the fused op: "
        "`docs/perf_notes.md`.")
    cpu_rows = sum(1 for row in rows if row.get("gpu") == "cpu")
    if cpu_rows:
        parts += ["", f"**CPU times:** {cpu_rows} of these rows were measured on a CPU "
                  "(`--include-cpu`): models in host memory, no GPU and no Triton kernel "
                  "(flag on runs the reference path there), so they check the plumbing, "
                  "not the speed targets, which are defined on GPUs (their verdicts below "
                  "say nothing about them)."]
    for benchmark, title in (("layer", "MoE layer (`launch/bench_layer.py`)"),
                             ("prefill", "Full-model prefill (`launch/prefill.py`)")):
        groups = workloads(rows, benchmark)
        parts += ["", f"## {title}", ""]
        if not groups:
            parts.append("No rows in the inputs: the GPU grid is `source scripts/device_setup.sh "
                         "&& bash scripts/gpu_bench_all.sh` (README, \"The benchmarks and the "
                         "report\").")
            continue
        parts += ["Targets:", ""] + target_lines(groups, benchmark)
        parts += ["", "Geometric means of t_baseline / t_on" + (
            " (sequence length >= 4096)" if TARGETS[benchmark]["min_seq"] else "") + ":", ""]
        parts.append(geomean_table(groups, benchmark))
        if plots.get(benchmark):
            parts += ["", f"![{benchmark} speedup vs sequence length]({plots[benchmark]})"]
        slower = slower_table(groups, benchmark)
        if slower:
            parts += ["", "Where flag on is slower than a baseline" + (
                " (sequence length >= 4096)" if TARGETS[benchmark]["min_seq"] else "")
                + " (host ms: the host time to run the forward's Python and enqueue its "
                "work, its waits in host syncs included, p50, slowest rank; `-`: not in "
                "the rows):", "", slower]
        parts += ["", "Every workload:", "", workload_table(groups, benchmark)]
        gone = missing_workloads(groups)
        if gone:
            parts += ["", "Not measured in these rows (the targets above leave them out):",
                      ""] + gone
    if breakdown_rows and (text := breakdown_section(list(breakdown_rows))):
        parts += ["", "## Where the host time goes (MoE layer)", "", text]
    parts += ["", "## Variants, exactly", "", labels_section(rows)]
    bad = disagreements(rows)
    parts += ["", "## Agreement with flag off", ""]
    parts += bad or [("Every variant agreed with `off` on every workload (criterion in each "
                      "row's `criterion` field).")]
    parts += ["", "## Run settings", "", settings_section(rows)]
    parts += ["", "## Hardware and software", "", environment_section(rows)]
    parts += ["", "## Commands", "", commands_section(rows, paths, out, breakdown_paths,
                                                     breakdown_rows, flags), ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------


def plot(groups: dict, benchmark: str, path: str) -> bool:
    """t_baseline / t_on against sequence length, one panel per (model, layout), one line
    per baseline; a dashed line at 1 (and the target). Returns False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels: dict = {}
    for (model, layout, layers, seq, backend), g in groups.items():
        panels.setdefault((model, layout, layers, backend), []).append((seq, g))
    bases = baselines_present(groups)
    cols = max(1, len({k[1] for k in panels}))
    layouts = sorted({k[1] for k in panels})
    models = sorted({k[0] for k in panels}, key=_model_rank)
    fig, axes = plt.subplots(len(models), cols, figsize=(4.2 * cols, 2.8 * len(models)),
                             squeeze=False)
    for ax_row in axes:
        for ax in ax_row:
            ax.set_visible(False)
    for (model, layout, layers, backend), points in panels.items():
        ax = axes[models.index(model)][layouts.index(layout)]
        ax.set_visible(True)
        tag = f" [{backend}]" if backend not in ("auto", "-") else ""
        for base in bases:
            xs = [seq for seq, g in points if speedup(g, base) is not None]
            ys = [speedup(g, base) for seq, g in points if speedup(g, base) is not None]
            if xs:
                ax.plot(xs, ys, marker="o", label=f"vs {base}{tag}")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        if model in FINE_GRAINED:
            ax.axhline(TARGETS[benchmark]["geomean"], color="grey", linewidth=0.8,
                       linestyle=":")
        seqs = sorted({seq for k, pts in panels.items() if k[:2] == (model, layout)
                       for seq, _ in pts})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(x) for x in seqs])
        ax.minorticks_off()
        ax.set_title(f"{model} {layout}" + (f" ({layers} layers)" if layers else ""),
                     fontsize=8)
        ax.set_xlabel("sequence length", fontsize=7)
        ax.set_ylabel("t_base / t_on", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.suptitle(f"{benchmark}: speedup of moe_gatherrs_overlap (> 1 faster; dotted: target)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Write the report (and its PNGs); print where. Exit status 0, 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m megatron_overlap.bench.make_report",
                                     description="Markdown report of layer/prefill rows")
    parser.add_argument("jsonl", nargs="*", help="JSON-lines files of benchmark rows")
    parser.add_argument("--out", default="results/report.md", help="report path (default "
                        "results/report.md, untracked; the committed report is regenerated "
                        "with --out docs/report.md); PNGs are written next to it")
    parser.add_argument("--include-cpu", action="store_true",
                        help="keep rows measured on a CPU (tests; not benchmark numbers)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    parser.add_argument("--breakdown", nargs="+", action="extend", default=[],
                        metavar="JSONL",
                        help="layer rows of a run with --host-breakdown: a section of host "
                             "time per stage, flag on against the baselines (these rows are "
                             "used for that section only; its rows without a breakdown are "
                             "skipped). Give it after the row files, or end its list with "
                             "another option")
    args = parser.parse_args(argv)
    if not args.jsonl:
        parser.error("no row files: give them before --breakdown (it takes every file "
                     "after it)" if args.breakdown else "no row files (JSON-lines files of "
                     "layer / prefill rows)")
    if not args.out or Path(args.out).is_dir():
        parser.error(f"--out {args.out!r}: expected the report's file path (not a directory)")
    try:
        raw, notes = load_rows(args.jsonl)
    except ValueError as err:
        parser.error(str(err))
    rows, more = select_rows(raw, include_cpu=args.include_cpu)
    notes.update(more)
    breakdown_rows = []
    if args.breakdown:
        extra = []
        try:
            for path in args.breakdown:
                got = [r for r in load_rows([path])[0] if r["benchmark"] == "layer"
                       and r.get("host_breakdown_us") is not None]
                if not got:
                    raise ValueError(
                        f"--breakdown {path}: no layer rows with host_breakdown_us (a "
                        "bench_layer.py --host-breakdown run's rows); if it is a row file "
                        "of the report, give it before --breakdown")
                for row in got:
                    check_breakdown_row(row, f"{path}: the {row['variant']} row of "
                                             f"{row['model']} {row['layout']} seq "
                                             f"{row['seq_length']}")
                extra += got
        except ValueError as err:
            parser.error(str(err))
        breakdown_rows = [r for r in extra if args.include_cpu or r.get("gpu") != "cpu"]
        groups, dropped = breakdown_workloads(breakdown_rows)
        cpu = len(extra) - len(breakdown_rows)
        if not groups:
            parser.error(f"--breakdown {' '.join(args.breakdown)}: no layer rows with "
                         "host_breakdown_us for flag on and a baseline (run bench_layer.py "
                         "with --host-breakdown)"
                         + (f"; {cpu} CPU rows were dropped (--include-cpu keeps them)"
                            if cpu else ""))
        for line in dropped:
            print(f"make_report: --breakdown leaves out {line}", file=sys.stderr)
    if not rows:
        print(f"make_report: no layer or prefill rows to report in {args.jsonl} "
              f"({notes}); nothing written" + ("" if args.include_cpu else
                                              " (CPU rows need --include-cpu)"),
              file=sys.stderr)
        return 2
    from megatron_overlap.bench.cli import make_folder

    try:
        make_folder(args.out)
    except ValueError as err:
        print(f"make_report: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        plots = {}
        for benchmark in ("layer", "prefill"):
            groups = workloads(rows, benchmark)
            png = out.with_name(f"{out.stem}_{benchmark}.png")
            if groups and not args.no_plots and plot(groups, benchmark, str(png)):
                plots[benchmark] = png.name
        flags = [flag for flag, on in (("--include-cpu", args.include_cpu),
                                       ("--no-plots", args.no_plots)) if on]
        out.write_text(render(rows, notes, args.jsonl, args.out, plots, breakdown_rows,
                              args.breakdown, flags))
    except OSError as err:
        print(f"make_report: cannot write {args.out} or its PNGs: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(rows)} rows" + "".join(
        f", {out.with_name(p)}" for p in plots.values()) + ")", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
