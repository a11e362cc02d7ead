"""Which implementation of the resource model runs: the C++ solver or the Python twin.

The C++ solver (`csrc/solver.cpp`, built by `pip install -e .` or `python setup.py build_ext
--inplace` as `megatron_overlap.resource._solver`) and the twin (`resource.model`) expose the
same functions (`ctas_per_sm`, `count_tiles`, `make_problem`, `gemm_end_ps`, `solve`,
`solve_batch`) and give the same results. `implementation()` returns the C++ module when it
is built, else the twin with a one-time warning. `MEGATRON_OVERLAP_SOLVER=python` forces the
twin (`=cpp` makes a missing extension an error).

    python3 -m megatron_overlap.resource.solver --bench     # timing of the C++ solver
"""

from __future__ import annotations

import argparse
import os
import timeit
import warnings
from types import ModuleType
from typing import Optional

from megatron_overlap.config import SOLVER_ENV  # noqa: F401 (re-export)
from megatron_overlap.resource import model as twin


try:
    from megatron_overlap.resource import _solver as _cpp
    _CPP_ERROR: Optional[BaseException] = None
except ImportError as _err:  # not built: the twin stands in
    _cpp = None
    _CPP_ERROR = _err

_warned = False


def cpp_module() -> Optional[ModuleType]:
    """The built C++ extension, or None."""
    return _cpp


def implementation(name: Optional[str] = None) -> ModuleType:
    """The module whose functions solve the model.

    Args:
        name: "cpp", "python", or None (the `MEGATRON_OVERLAP_SOLVER` variable, else "cpp"
            when built and "python" otherwise).

    Raises:
        ValueError: unknown name.
        ImportError: "cpp" asked for and the extension is not built (says how to build it).
    """
    global _warned
    explicit_arg = name is not None
    if name:
        explicit = True
    else:
        env = os.environ.get(SOLVER_ENV)
        explicit = explicit_arg or bool(env)
        name = env or "cpp"
    if name == "python":
        return twin
    if name != "cpp":
        where = "solver" if explicit_arg else SOLVER_ENV
        raise ValueError(f"{where}={name!r}: expected 'cpp' or 'python'")
    if _cpp is not None:
        return _cpp
    if explicit:
        raise ImportError("the C++ resource solver megatron_overlap.resource._solver is not "
                          "built (pip install -e . or python setup.py build_ext --inplace): "
                          f"{_CPP_ERROR}")
    if not _warned:
        _warned = True
        warnings.warn("megatron_overlap.resource._solver (C++) is not built; the resource "
                      "manager runs its Python twin (same plans, slower). Build it with "
                      "`pip install -e .` or `python setup.py build_ext --inplace`.",
                      stacklevel=2)
    return twin


def implementation_name(name: Optional[str] = None) -> str:
    """"cpp" or "python": which module `implementation(name)` returns (the benchmarks'
    rows record it, since the Python twin is ~15x slower on the host).

    Raises:
        as `implementation`.
    """
    return "python" if implementation(name) is twin else "cpp"


def _bench() -> int:
    if _cpp is None:
        print(f"the C++ solver is not built: {_CPP_ERROR}")
        return 1
    # (G, T_r, T_l, tau, c_link, c_cta): Mixtral-8x7B-like EP2 (compute-bound, O(1) path),
    # a small-tile case (link binds, binary search), remote only.
    cases = {
        "mixtral-like": (132, 1152, 1120, 124_000_000, 99_000, 2_000_000),
        "link-bound": (132, 5000, 800, 3_000_000, 400_000, 2_000_000),
        "remote-only": (132, 4000, 0, 20_000_000, 99_000, 2_000_000),
    }
    print("| case | C++ loop ns/call | from Python us/call (C++) | twin us/call |")
    print("|---|---|---|---|")
    for label, p in cases.items():
        loop_ns = min(_cpp.bench_solve(*p, 200_000) for _ in range(5))
        n = 20_000
        py_us = min(timeit.repeat(lambda p=p: _cpp.solve(*p), number=n, repeat=5)) / n * 1e6
        tw_us = min(timeit.repeat(lambda p=p: twin.solve(*p), number=20, repeat=3)) / 20 * 1e6
        print(f"| {label} | {loop_ns:.1f} | {py_us:.2f} | {tw_us:.0f} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Resource solver: implementation and timing.")
    parser.add_argument("--bench", action="store_true",
                        help="time solve() in a C++ loop, from Python, and the Python twin")
    args = parser.parse_args(argv)
    try:
        chosen = implementation()  # what the resource manager will use, $SOLVER_ENV included
    except (ValueError, ImportError) as err:
        print(f"error: {err}")
        return 2
    if args.bench:
        return _bench()
    name = "cpp" if chosen is _cpp else "python"
    built = "built" if _cpp is not None else f"not built: {_CPP_ERROR}"
    print(f"implementation: {name} (C++ extension {built})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
