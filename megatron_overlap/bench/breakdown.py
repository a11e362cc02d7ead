"""Where a forward's time goes: host time per stage, and one profiled forward per variant.

The launchers' `--host-breakdown` (`launch/bench_layer.py`: one `MoELayer`;
`launch/prefill.py`: a whole `GPTModel`) wrap chosen methods of the module instances in host
timers (`megatron_overlap.profiling.span`, instance attributes that shadow the class's
method and are removed afterwards), switch the flag-on path's own `mo.*` spans on
(`profiling.host_times`), run a few forwards and report, per variant and stage, the median
over the forwards of the stage's host microseconds in one forward.

Stage names:

* an MoE layer's: "layer.<method>" (`MOE_LAYER_STAGES[""]`: the steps Megatron's
  `MoELayer.forward` calls, the shared experts' included), "token_dispatcher.<method>",
  "experts.<method>", the flag-on path's "mo.*", and inside the grouped FC1 (flag on and
  `off-grouped` alike: `megatron.grouped_experts`) "fc1.weights" (the stacked weights'
  view), "fc1.counts", "fc1.gate_half" / "fc1.linear_half" (the SwiGLU FC1's two grouped
  GEMMs), "fc1.swiglu", and "grouped_mm.offsets" / "grouped_mm.call" (every grouped GEMM's
  offsets upload and torch call, `off-grouped`'s FC2 included);
* a model's (`model_targets`): the MoE layers' names above, summed over its MoE layers; and
  "model.embedding", "model.output_layer", "decoder.final_layernorm",
  "decoder.input_layernorm", "decoder.self_attention", "decoder.pre_mlp_layernorm",
  "decoder.dense_mlp" (a dense layer's MLP) and "decoder.moe_layer" (the MoE layers' whole
  forward), each summed over the decoder's layers.

"forward" is the whole call's median host time and "python.gc" the mean time per forward
Python's cyclic garbage collector ran inside the forwards (its passes are rare and long, so
a median would hide them). No device sync inside a forward: a stage's time is its enqueue
time plus any host sync it makes (Megatron's dispatcher waits for its split sizes once per
forward), so a stage that syncs also carries the device work queued before it.

`profile_forwards` is the launchers' `--profile`: one forward per variant under
`torch.profiler` (CPU + CUDA), its operator / kernel table and, optionally, its chrome trace
(`launch/trace_summary.py` reads those: device busy time, idle gaps, top kernels).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch.distributed as dist

import torch

from megatron_overlap.bench.measure import percentile, reduce_max, sync

MOE_LAYER_STAGES: Dict[str, Tuple[str, ...]] = {
    "": ("route", "preprocess", "dispatch", "shared_experts_compute", "routed_experts_compute",
         "combine", "postprocess"),
    "token_dispatcher": ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                         "combine_preprocess", "token_combine", "combine_postprocess",
                         "prepare_combine", "combine_send", "combine_finish"),
    "experts": ("forward", "forward_fc1"),
}
"""Methods of an MoE layer that `moe_layer_targets` times: {attribute of the layer ("" =
the layer itself): method names}: the steps megatron-core 0.19's `MoELayer.forward` calls
(`shared_experts_compute` only in layers with shared experts), the dispatcher's and the
experts'; a method the instance lacks is skipped (the flag-off dispatcher has no
`prepare_combine`)."""

Target = Tuple[object, str, str]
"""(object, method name, stage name): a method to time and the stage it counts towards."""


def moe_layer_targets(layer: torch.nn.Module) -> List[Target]:
    """The `MOE_LAYER_STAGES` methods of one MoE layer (`megatron.core.transformer.moe.
    moe_layer.MoELayer` or a subclass) as targets, named "layer.<m>", "token_dispatcher.<m>",
    "experts.<m>"."""
    targets = []
    for attr, methods in MOE_LAYER_STAGES.items():
        owner = getattr(layer, attr, None) if attr else layer
        if owner is None:
            continue
        for method in methods:
            if callable(getattr(owner, method, None)):
                targets.append((owner, method, f"{attr or 'layer'}.{method}"))
    return targets


def model_targets(model: torch.nn.Module) -> List[Target]:
    """Targets of a Megatron `GPTModel` (see the module docstring for the names): its
    embedding, output layer and final norm, every decoder layer's norms, attention and MLP
    (`forward` of each submodule), and inside every MoE layer `moe_layer_targets`.

    Raises:
        TypeError: `model` has no `decoder.layers` (not a Megatron GPT model).
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"model_targets needs a GPTModel (with decoder.layers); got "
                        f"{type(model).__name__}")
    targets: List[Target] = []
    for name in ("embedding", "output_layer"):
        module = getattr(model, name, None)
        if isinstance(module, torch.nn.Module):
            targets.append((module, "forward", f"model.{name}"))
    final = getattr(decoder, "final_layernorm", None)
    if isinstance(final, torch.nn.Module):
        targets.append((final, "forward", "decoder.final_layernorm"))
    for layer in layers:
        for name in ("input_layernorm", "self_attention", "pre_mlp_layernorm"):
            module = getattr(layer, name, None)
            # (IdentityOp norms are still modules: timed, and nearly free)
            if isinstance(module, torch.nn.Module):
                targets.append((module, "forward", f"decoder.{name}"))
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoELayer):
            targets.append((mlp, "forward", "decoder.moe_layer"))
            targets += moe_layer_targets(mlp)
        elif isinstance(mlp, torch.nn.Module):
            targets.append((mlp, "forward", "decoder.dense_mlp"))
    return targets


class _Patched:
    """Inside: every target's method is an instance attribute that runs the original inside
    `span(stage)`; on exit the instance is as before (an instance attribute that was there is
    put back, one that was not is removed)."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = list(targets)
        self.saved: list = []

    def __enter__(self) -> "_Patched":
        from megatron_overlap.profiling import span

        try:
            for owner, method, stage in self.targets:
                fn = getattr(owner, method)

                def timed(*args, _fn=fn, _stage=stage, **kwargs):
                    with span(_stage):
                        return _fn(*args, **kwargs)

                self.saved.append((owner, method, owner.__dict__.get(method)))
                setattr(owner, method, timed)
        except BaseException:
            self.__exit__()  # (the with block never starts: undo what was patched)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for owner, method, own in reversed(self.saved):
            if own is None:
                delattr(owner, method)
            else:
                setattr(owner, method, own)
        self.saved.clear()


def host_breakdown(variants: Dict[str, Tuple[Callable[[], object], Sequence[Target]]],
                   device: torch.device, iters: int) -> Dict[str, Dict[str, float]]:
    """Host microseconds per stage of one forward, per variant: {variant: {stage: us}}.

    Args:
        variants: {name: (forward, targets)}: `forward()` runs one forward of the variant
            (called under `torch.inference_mode()`), `targets` its methods to time
            (`moe_layer_targets`, `model_targets`).
        device: where the forwards run (synced before each forward, as the timing does).
        iters: forwards per variant (>= 1).

    Returns:
        Per variant: "forward", "python.gc" and every stage entered on some rank (see the
        module docstring); a stage entered several times in a forward counts the sum, a
        forward that did not enter it 0. Every value is the maximum over the ranks, stage
        by stage, so on several ranks the stages inside a stage may add up to more than it
        (each maximum may come from another rank). The variants run one after another,
        each its `iters` forwards back to back (not in the timing's alternating order).
        Collective: every rank calls it with the same variants.

    Raises:
        ValueError: `iters` < 1.
    """
    from megatron_overlap.profiling import host_times

    if iters < 1:
        raise ValueError(f"host_breakdown: iters={iters}, expected >= 1")
    gc_time = [0.0]
    gc_start = [None]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        elif gc_start[0] is not None:
            gc_time[0] += time.perf_counter() - gc_start[0]
            gc_start[0] = None

    out: Dict[str, Dict[str, float]] = {}
    gc.callbacks.append(on_gc)
    try:
        with torch.inference_mode():
            for name, (forward, targets) in variants.items():
                times_, per_forward, gc_total = [], [], 0.0
                with _Patched(targets):
                    for _ in range(iters):
                        sync(device)
                        gc_time[0] = 0.0
                        with host_times() as times:
                            t0 = time.perf_counter()
                            forward()
                            times_.append(time.perf_counter() - t0)
                        gc_total += gc_time[0]
                        per_forward.append({k: sum(v) for k, v in times.items()})
                    sync(device)
                stages = {"forward": percentile(times_, 50) * 1e6,
                          "python.gc": gc_total / iters * 1e6}
                for key in sorted({k for f in per_forward for k in f}):
                    stages[key] = percentile([f.get(key, 0.0) for f in per_forward], 50) * 1e6
                out[name] = stages
    finally:
        gc.callbacks.remove(on_gc)
    # max over ranks, stage by stage, over the union of every rank's stage names (a rank
    # that did not enter a stage counts 0 there): one all-reduce per variant of the same
    # length on every rank
    for name in out:
        keys = sorted(_all_stage_names(out[name]))
        values = reduce_max([out[name].get(k, 0.0) for k in keys], device)
        out[name] = dict(zip(keys, values))
    return out


def _all_stage_names(stages: Dict[str, float]) -> set:
    """The union over the ranks of `stages`' names (this rank's alone without a process group
    of more than one rank)."""
    names = set(stages)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(names))
        for other in gathered:
            names.update(other)
    return names


def breakdown_table(breakdown: Dict[str, Dict[str, float]], title: str) -> str:
    """`host_breakdown`'s result as text: one line per stage ("forward" first, then by
    name), one column per variant (us; "-": the variant has no such stage)."""
    names = list(breakdown)
    stages = ["forward"] + sorted({s for v in breakdown.values() for s in v} - {"forward"})
    width = max(len(s) for s in stages)
    lines = [f"== host us per forward {title} (max over ranks)",
             " " * width + "".join(f"{n:>14}" for n in names)]
    for stage in stages:
        cells = "".join(f"{breakdown[n][stage]:14.1f}" if stage in breakdown[n]
                        else f"{'-':>14}" for n in names)
        lines.append(f"{stage:<{width}}{cells}")
    return "\n".join(lines)


def profile_forwards(variants: Dict[str, Callable[[], object]], device: torch.device,
                     title: str, row_limit: int = 25, trace_prefix: str = "") -> str:
    """One profiled forward of each variant (`torch.profiler`, CPU and, on CUDA, CUDA
    activity), after the device is idle and the ranks line up; returns rank 0's operator /
    kernel tables, sorted by device time on CUDA (CPU time otherwise), one per variant
    headed "== profile <title> <variant>". With `trace_prefix`, rank 0 also writes
    `<trace_prefix>_<variant>.json` (chrome trace). Collective: every rank runs the
    forwards (they hold collectives); the process group must be initialised.

    Raises:
        RuntimeError: the chrome trace was not written (the profiler only logs that).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_by = "cuda_time_total" if cuda else "cpu_time_total"
    texts = []
    with torch.inference_mode():
        for name, forward in variants.items():
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            with profile(activities=activities) as prof:
                forward()
                if cuda:
                    torch.cuda.synchronize(device)
            if trace_prefix and dist.get_rank() == 0:
                path = f"{trace_prefix}_{name}.json"
                prof.export_chrome_trace(path)
                if not os.path.isfile(path):  # (the exporter only logs its failures)
                    raise RuntimeError(f"the profiler wrote no chrome trace to {path!r}")
            texts.append(f"== profile {title} {name}\n"
                         + prof.key_averages().table(sort_by=sort_by, row_limit=row_limit))
    return "\n".join(texts)
