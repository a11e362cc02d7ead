"""Launching compiled Triton kernels with less host work per call.

`kernel[grid](*args, **meta)` binds and specialises every argument on every call (Triton's
`JITFunction.run`: argument binding, a specialisation key per argument, a cache lookup)
before it reaches the compiled kernel's launcher. The fused op launches three or four
kernels per MoE layer forward on the host's critical path, so `FastLauncher` keeps, per
argument *key*, the `CompiledKernel` that the first normal launch returned and then calls
its launcher directly (`CompiledKernel[grid](*args)`, Triton's own entry point for an
already compiled kernel).

The key is a superset of what Triton specialises on, so a cached kernel is only reused
where Triton would have picked the same one: each tensor's dtype and 16-byte alignment,
each integer's type range (int32 / int64 / uint64), whether it is 1 and whether it is a
multiple of 16 (for every integer, also those marked `do_not_specialize`: a few more cache
entries, never a wrong one), bools, None, floats by type, the constexprs, num_warps /
num_stages and the current CUDA device. Arguments of other kinds, and every launch off
CUDA (the interpreter), take the normal path. The fast path skips what `JITFunction.run`
does besides binding: Triton's pre-run hooks, its runtime debug / instrumentation knobs and
its check that the kernel's global variables did not change (the kernels here use none).

`MEGATRON_OVERLAP_FAST_LAUNCH=0` turns it off (every launch through `JITFunction.run`).

`MEGATRON_OVERLAP_FAST_LAUNCH=direct` (opt-in, v5.4) goes one level lower with Triton 3.6
(the GPU machines' version; `DIRECT_LAUNCH_TRITON`): a cached kernel is launched straight
through the C launcher that Triton generated for it (`CompiledKernel.run.launch`), with
what Triton's runner would pass it computed once per key (the function handle, the packed
metadata, the cooperative-grid and PDL flags) and, per launch, only what Triton computes
per launch (the current stream, the global scratch from Triton's allocator). That skips
the runner closure, the launch-metadata call and the launcher object's `__call__`
(`_direct_launch`). Where a launch hook is set (`triton.knobs.runtime.launch_enter_hook` /
`launch_exit_hook`, e.g. a profiler), where the kernel asks for profile scratch, and with
any other Triton, the cached kernel's own `CompiledKernel[grid]` runs instead. It is
opt-in because it depends on Triton's launcher internals and no gain was resolved:
`bench_layer.py --alt-env MEGATRON_OVERLAP_FAST_LAUNCH=direct` (against the default in one
process) put `direct` at -0.04 ms per layer forward in v5.4 and at +0.07 ms in v5.5 (that
A/B the other way round: `=1` against `direct` as the default), both within the host's
noise (docs/perf_notes.md).

Measured on the GPU machine with Triton 3.6 (docs/perf_notes.md v4.7; a do-nothing kernel
with 8 tensor and 16 int arguments, warm): the JIT path 20-23 us, this one 20-23 us, the
compiled kernel called directly 11-12 us. So with that Triton it saves nothing: Triton's
own binding has caught up, and this key costs as much. It stays because it is no slower
and keeps the older Tritons' gain; a key limited to what changes between calls of one
launch site would save the difference.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Tuple

import torch

from megatron_overlap._host import getenv

FAST_LAUNCH_ENV = "MEGATRON_OVERLAP_FAST_LAUNCH"
"""Environment variable: "0" launches through Triton's JIT every time; "1" or unset: reuse
the compiled kernel; "direct": reuse it and call its C launcher directly (see the module
docstring)."""


def fast_launch_mode() -> str:
    """$MEGATRON_OVERLAP_FAST_LAUNCH: "0", "1" (also when unset or empty) or "direct".

    Raises:
        ValueError: any other value.
    """
    value = getenv(FAST_LAUNCH_ENV, "")
    if value not in ("", "0", "1", "direct"):
        raise ValueError(f"{FAST_LAUNCH_ENV}={value!r}: expected '0', '1' or 'direct'")
    return value or "1"


def fast_launch_enabled() -> bool:
    """$MEGATRON_OVERLAP_FAST_LAUNCH: True unless "0" (`fast_launch_mode`).

    Raises:
        ValueError: a value other than "0", "1", "direct" or empty.
    """
    return fast_launch_mode() != "0"


_PLAIN = (torch.Tensor, int, float, bool, type(None))
_Tensor = torch.Tensor
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device

DIRECT_LAUNCH_TRITON = ("3.6.",)
"""Triton versions (prefixes) whose launcher internals `_direct_launch` was written
against (docs/perf_notes.md v5.3, v5.4); others launch through `CompiledKernel[grid]`."""


def _direct_launch(compiled, device: int):
    """A `go(grid, args)` that launches `compiled` through its generated C launcher as
    Triton 3.6's `CompiledKernel.__getitem__` runner and `CudaLauncher.__call__` do
    (returns False, launching nothing, where a launch hook is set), or None where this
    Triton or this kernel is not one it handles (see the module docstring)."""
    import triton

    if not triton.__version__.startswith(DIRECT_LAUNCH_TRITON):
        return None
    try:
        from triton import knobs
        from triton.runtime import _allocation
        from triton.runtime.driver import driver

        run = compiled.run  # (initialises the module and function handles)
        launch, function, packed = run.launch, compiled.function, compiled.packed_metadata
        num_ctas, size, align = run.num_ctas, run.global_scratch_size, run.global_scratch_align
        coop, pdl, profile_size = (run.launch_cooperative_grid, run.launch_pdl,
                                   run.profile_scratch_size)
        allocator = _allocation._allocator
        get_stream = driver.active.get_current_stream
        hooks = knobs.runtime
    except (AttributeError, ImportError, RuntimeError):  # (RuntimeError: no active driver)
        return None
    if profile_size:
        return None

    def go(grid, args):
        if hooks.launch_enter_hook is not None or hooks.launch_exit_hook is not None:
            return False  # a hook wants the launch metadata: Triton's own runner
        stream = get_stream(device)
        scratch = None
        if size > 0:
            scratch = allocator.get()(grid[0] * grid[1] * grid[2] * num_ctas * size, align,
                                      stream)
        launch(grid[0], grid[1], grid[2], stream, function, coop, pdl, scratch, None, packed,
               None, None, None, *args)
        return True

    return go


def _as_kernel_arg(arg: Any) -> Any:
    """numpy and other integral scalars as Python ints (Triton's JIT rejects numpy ints),
    other real scalars (numpy floats) as Python floats. The common kinds return at the
    first check."""
    if type(arg) in _PLAIN or isinstance(arg, torch.Tensor):
        return arg
    if isinstance(arg, numbers.Integral):
        return int(arg)
    return float(arg) if isinstance(arg, numbers.Real) else arg


class FastLauncher:
    """Launch `fn` (a `triton.jit` function whose constexpr parameters come last) reusing
    its compiled kernels; see the module docstring.

    Call as `launcher(grid, *args, **meta)`: args are the non-constexpr arguments in order,
    meta the constexprs by name plus launch options (num_warps, num_stages). Returns the
    `CompiledKernel` (the normal path's return value).
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self._cache: Dict[Tuple, Any] = {}
        # key -> `_direct_launch` of its kernel (None: it declined), made at the key's first
        # launch in mode "direct"
        self._direct: Dict[Tuple, Any] = {}
        self._constexpr_names = None  # the interpreter's functions: always the normal path
        if hasattr(fn, "constexprs"):
            constexprs = sorted(fn.constexprs)
            num_args = len(fn.arg_names)
            if constexprs != list(range(num_args - len(constexprs), num_args)):
                raise ValueError(f"{fn.arg_names}: FastLauncher needs the constexpr "
                                 f"parameters last (constexprs at {constexprs})")
            self._constexpr_names = [fn.arg_names[i] for i in constexprs]

    @staticmethod
    def _on_gpu(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    @staticmethod
    def _device() -> int:
        # where Triton launches (`torch.cuda.current_device()` without its lazy-init check:
        # only asked once a GPU tensor is among the arguments, so CUDA is initialised)
        return _cuda_get_device()

    def __call__(self, grid, *args, **meta):
        mode = fast_launch_mode()
        if self._constexpr_names is None or mode == "0":
            return self.fn[grid](*(_as_kernel_arg(a) for a in args), **meta)
        # One pass over the arguments for their key (the module docstring's distinctions,
        # flattened: this runs for every argument of every launch on the host's critical
        # path). An int is one small int: its type range (0 int32, 4 int64, 8 beyond), +2 if it is 1, +1
        # if a multiple of 16; a tensor its dtype, then whether it is 16-byte aligned (a
        # dtype is never an int, so the flat key reads back one way only); a bool "b1" /
        # "b0"; a float the type float; None itself. Anything else (numpy ints) takes
        # `_converted`.
        keys, first = [], None
        push = keys.append
        for a in args:
            kind = type(a)
            if kind is int:
                push((0 if -2**31 <= a < 2**31 else (4 if -2**63 <= a < 2**63 else 8))
                     + (a == 1) * 2 + (a % 16 == 0))
            elif kind is _Tensor or isinstance(a, _Tensor):
                if first is None:
                    first = a
                push(a.dtype)
                push(a.data_ptr() % 16 == 0)
            elif kind is bool:
                push("b1" if a else "b0")
            elif a is None:
                push(None)
            elif kind is float:
                push(float)  # Triton does not specialise on float values
            else:
                return self._converted(grid, args, meta)
        if first is None or not self._on_gpu(first):
            return self.fn[grid](*args, **meta)
        # kwargs keep their call-site order: one call site, one key (another order would
        # only add a cache entry)
        key = (self._device(), tuple(keys), tuple(meta.items()))
        return self._launch_keyed(grid, key, list(args), meta, mode)

    def _converted(self, grid, args, meta):
        """`__call__` for arguments of other kinds than int, float, bool, None and tensors:
        numpy and other integral scalars become ints (`_as_kernel_arg`) and the launch goes
        on as for those (the same key); a kind that stays another goes through Triton's own
        path."""
        conv = [_as_kernel_arg(a) for a in args]
        if any(type(a) not in _PLAIN and not isinstance(a, _Tensor) for a in conv):
            return self.fn[grid](*conv, **meta)
        return self(grid, *conv, **meta)

    def _launch_keyed(self, grid, key, conv: list, meta, mode):
        try:
            compiled = self._cache.get(key)
        except TypeError:  # an unhashable keyword value: Triton's own path
            return self.fn[grid](*conv, **meta)
        if compiled is None:
            compiled = self.fn[grid](*conv, **meta)
            self._cache[key] = compiled
        else:
            # The compiled kernel's runner reads grid[0], grid[1], grid[2].
            if len(grid) != 3:
                grid = tuple(grid) + (1,) * (3 - len(grid))
            conv.extend([meta[name] for name in self._constexpr_names])
            if mode == "direct":
                go = self._direct.get(key, False)
                if go is False:
                    go = self._direct[key] = _direct_launch(compiled, key[0])
                if go is not None and go(grid, conv):
                    return compiled
            compiled[grid](*conv)
        return compiled
