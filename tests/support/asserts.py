"""Assertion helpers that say where two tensors differ (STYLE.md rule 8)."""

from __future__ import annotations

from typing import Optional

import torch


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, what: str
) -> None:
    """`torch.testing`-style closeness with a report of where it differs.

    Reports shape/dtype mismatches, NaN/Inf counts, the number of mismatches, the first
    mismatching indices with both values, and the max abs and rel errors.
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    actual, expected = actual.double(), expected.double()
    nonfinite = (~torch.isfinite(actual)).sum().item()
    abs_err = (actual - expected).abs()
    bad = ~(abs_err <= atol + rtol * expected.abs())  # NaN counts as bad
    if nonfinite == 0 and not bad.any():
        return
    rel_err = abs_err / expected.abs().clamp_min(torch.finfo(torch.float32).tiny)
    first = bad.nonzero()[:5].tolist()
    samples = ", ".join(
        f"{tuple(i)}: {actual[tuple(i)].item():.8g} vs {expected[tuple(i)].item():.8g}"
        for i in first
    )
    raise AssertionError(
        f"{what}: {int(bad.sum())}/{bad.numel()} elements differ beyond atol={atol}, "
        f"rtol={rtol}; NaN/Inf in actual: {nonfinite}; max abs err "
        f"{abs_err.nan_to_num(float('inf')).max().item():.3g}, max rel err "
        f"{rel_err.nan_to_num(float('inf')).max().item():.3g}; first: {samples}"
    )


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: the error of a sum relative to its scale.

    0.0 for empty tensors; NaN/Inf in `actual` give inf.
    """
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().clamp(min=1e-12)
    err = (actual - expected).abs().nan_to_num(float("inf")).max()
    return float(err / scale)


def describe_mismatch(
    actual: torch.Tensor, expected: torch.Tensor, *, rel_tol: float
) -> Optional[str]:
    """None when `max_rel_error(actual, expected) <= rel_tol`, else a report: shapes, NaN/Inf
    count, number of elements beyond tolerance, the first indices with both values, the
    max relative error. Picklable, so ranks can send it back to the test."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = max_rel_error(actual, expected)
    if error <= rel_tol:
        return None
    a, e = actual.double(), expected.double()
    bad = ~((a - e).abs() <= rel_tol * e.abs().max())
    first = bad.nonzero()[:4].tolist()
    samples = ", ".join(f"{tuple(i)}: {a[tuple(i)].item():.6g} vs {e[tuple(i)].item():.6g}"
                        for i in first)
    nonfinite = int((~torch.isfinite(a)).sum())
    return (f"max rel error {error:.3g} > {rel_tol:.3g}; {int(bad.sum())}/{bad.numel()} "
            f"elements off; NaN/Inf: {nonfinite}; first: {samples}")
