"""The C++ `direct_layout` (megatron_overlap.ops._layout) against its numpy twin: same
tables on random and real metadata, ValueError on bad input. Skipped where the extension is
not built (`python setup.py build_ext --inplace`)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from megatron_overlap.bench.workloads import rank_rows, routing_maps
from megatron_overlap.metadata import build_metadata
from megatron_overlap.ops import triton_gemm2_gatherrs as op

cpp = op._layout_cpp
if cpp is None:
    # CI builds it (pip install -e .): there a missing extension is an error, not a skip.
    assert not os.environ.get("CI"), "CI must build megatron_overlap.ops._layout"
    pytest.skip("C++ layout not built (python setup.py build_ext --inplace)",
                allow_module_level=True)

LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2)]
TILES = [(bm, bn) for bm in (16, 64, 128) for bn in (16, 128, 256)]


def make_meta(routed, tp, ep, rank):
    """Triton-only metadata of `rank` from the exchanged counts `routed` [R, E] (the routing
    map is a placeholder: validate=False)."""
    counts = np.concatenate([routed, np.ones((tp * ep, ep), np.int64)], axis=1)
    return build_metadata(counts=counts, row_slot=None, dest_token_mask=None, tp_size=tp,
                          tp_rank=rank % tp, ep_size=ep, ep_rank=rank // tp, topk=1,
                          routing_map=torch.zeros(5, routed.shape[1], dtype=torch.bool),
                          validate=False)


def random_meta(rng, tp, ep, rank, num_local):
    """Random counts with zero-token experts and, now and then, zero-token ranks."""
    r, e = tp * ep, num_local * ep
    routed = rng.integers(0, rng.choice([3, 40, 700]), (r, e))
    routed[rng.random((r, e)) < 0.3] = 0
    routed[rng.random(r) < 0.2] = 0
    return make_meta(routed, tp, ep, rank)


def assert_same(a, b):
    for f in dataclasses.fields(op.DirectLayout):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(y, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert type(x) is int and x == y, f.name


def cpp_layout(meta, hidden, bm, bn):
    assert op._layout_cpp is cpp  # direct_layout dispatches to the extension
    return op.direct_layout(meta, hidden, bm, bn)


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_random_metadata(tp, ep):
    rng = np.random.default_rng(100 * tp + ep)
    for _ in range(40):
        meta = random_meta(rng, tp, ep, int(rng.integers(tp * ep)), int(rng.integers(1, 9)))
        bm, bn = TILES[rng.integers(len(TILES))]
        hidden = int(rng.choice([bn, 4 * bn, int(rng.integers(1, 3000))]))
        assert_same(cpp_layout(meta, hidden, bm, bn), op.direct_layout_numpy(meta, hidden, bm, bn))


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_real_metadata(tp, ep):
    r = tp * ep
    tokens = [0 if g == r - 1 and r > 1 else 23 + 7 * g for g in range(r)]  # one empty rank
    maps = routing_maps(tokens, 4 * ep, 2, "sparse", seed=tp + ep)
    for rank in range(r):
        meta = rank_rows(maps, tp=tp, ep=ep, rank=rank, topk=2).meta
        for bm, bn in TILES[::4]:
            assert_same(cpp_layout(meta, 300, bm, bn), op.direct_layout_numpy(meta, 300, bm, bn))


@pytest.mark.parametrize("hidden,bn,routed", [
    (2**30, 1, 1),        # first tile / tile count
    (64, 64, 2**30),      # a row of h (L * R runs of 2**30 rows)
])
def test_int32_overflow(hidden, bn, routed):
    meta = make_meta(np.full((2, 4), routed), 1, 2, 0)
    for impl in (op.direct_layout_numpy, cpp_layout):
        with pytest.raises(ValueError, match="a row or tile coordinate does not fit in int32"):
            impl(meta, hidden, 16, bn)


def test_bad_input():
    routed = np.ones((4, 8), np.int64)  # R = 4 (tp 2, ep 2), E = 8, L = 4
    good = {"routed": routed, "rows_per_expert_per_chunk": np.ones((4, 4), np.int32),
            "tp_size": 2, "ep_size": 2, "tp_rank": 1, "ep_rank": 0, "hidden": 64, "bm": 16,
            "bn": 16}
    assert cpp.direct_layout(**good)[0].shape == (16, 6)  # any integer dtype goes
    for change, match in [
        ({"routed": np.ones((3, 8), int)}, r"routed must be \[R=4, E\].*\(3, 8\)"),
        ({"routed": np.ones((4, 7), int)}, r"positive multiple of ep_size=2"),
        ({"routed": np.ones((4, 0), int)}, r"positive multiple"),
        ({"routed": np.ones(4, int)}, r"got shape \(4,\)"),
        ({"rows_per_expert_per_chunk": np.ones((4, 2), int)},
         r"\[L=4, R=4\], got shape \(4, 2\)"),
        ({"rows_per_expert_per_chunk": -np.ones((4, 4), int)}, r"must be in \[0, 2\^31\)"),
        ({"routed": -routed}, r"must be in \[0, 2\^31\)"),
        ({"routed": routed * 2**31}, r"routed counts must be in \[0, 2\^31\)"),
        ({"routed": routed * 1.7}, r"routed must be an integer array, got dtype float64"),
        ({"hidden": 2**31}, r"must be < 2\^31"),
        ({"tp_rank": 2}, r"tp_rank=2 of tp_size=2"),
        ({"ep_size": 0}, r"expected sizes >= 1"),
        ({"bm": 0}, r"bm >= 1"),
        ({"hidden": -1}, r"hidden >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            cpp.direct_layout(**{**good, **change})


def test_metadata_without_routed_counts():
    meta = dataclasses.replace(make_meta(np.ones((2, 4), np.int64), 1, 2, 1), routed_counts=None)
    for impl in (op.direct_layout_numpy, cpp_layout):
        with pytest.raises(ValueError, match="without routed_counts"):
            impl(meta, 64, 16, 16)


def test_numpy_fallback(monkeypatch):
    meta = make_meta(np.arange(16).reshape(2, 8) % 5, 1, 2, 1)
    expected = cpp_layout(meta, 200, 16, 128)
    monkeypatch.setattr(op, "_layout_cpp", None)  # as on a machine without the build
    assert_same(op.direct_layout(meta, 200, 16, 128), expected)


def tables_of(meta, hidden, bm, bn, expected, pad=3):
    """`direct_tables` of `meta` into a fresh buffer (poisoned, with `pad` spare elements);
    returns (result, buffer, next_expected)."""
    r, e = meta.group_size, meta.routed_counts.shape[1]
    need = 2 * r + meta.tp_size * e + r * meta.num_local_experts * 6
    out = np.full(need + pad, -7, np.int32)
    nxt = np.full(r, -1, np.int64)
    result = cpp.direct_tables(meta.routed_counts, meta.tp_size, meta.ep_size, meta.tp_rank,
                               meta.ep_rank, hidden, bm, bn, expected, nxt, out)
    return result, out, nxt


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_direct_tables_match_the_layout(tp, ep):
    """The fused tables (what `_Call` uploads) hold the twin's values: targets = running
    totals + arrivals, finalize bases, segments, in that order; nothing past them written."""
    rng = np.random.default_rng(7 * tp + ep)
    for _ in range(40):
        meta = random_meta(rng, tp, ep, int(rng.integers(tp * ep)), int(rng.integers(1, 9)))
        bm, bn = TILES[rng.integers(len(TILES))]
        hidden = int(rng.choice([bn, 4 * bn, int(rng.integers(1, 3000))]))
        want = op.direct_layout_numpy(meta, hidden, bm, bn)
        expected = rng.integers(0, 2**40, tp * ep).astype(np.int64)
        result, out, nxt = tables_of(meta, hidden, bm, bn, expected)
        r, nb = tp * ep, want.finalize_base.size
        assert np.array_equal(nxt, expected + want.arrivals)
        assert np.array_equal(out[:2 * r].view(np.int64), nxt)
        assert np.array_equal(out[2 * r: 2 * r + nb], want.finalize_base.reshape(-1))
        assert np.array_equal(out[2 * r + nb: -3], want.segments.reshape(-1))
        assert (out[-3:] == -7).all()
        me = meta.ep_rank * tp + meta.tp_rank
        assert result == (want.num_remote, want.num_local, want.col_blocks, want.local_rows,
                          int(want.recv_rows[me]), int(want.recv_rows.max()),
                          int(want.segments[:, 2].sum()), want.num_pairs)


def test_direct_tables_bad_input():
    meta = make_meta(np.ones((4, 8), np.int64), 2, 2, 1)
    good = dict(routed=meta.routed_counts, tp_size=2, ep_size=2, tp_rank=1, ep_rank=0,
                hidden=64, bm=16, bn=16, expected=np.zeros(4, np.int64),
                next_expected=np.zeros(4, np.int64), out=np.zeros(8 + 16 + 96, np.int32))
    assert cpp.direct_tables(**good)[0] > 0
    frozen = np.zeros(4, np.int64)
    frozen.flags.writeable = False
    for change, match in [
        ({"routed": np.ones((3, 8), int)}, r"routed must be \[R=4, E\].*\(3, 8\)"),
        ({"routed": -np.ones((4, 8), int)}, r"routed counts must be in \[0, 2\^31\)"),
        ({"tp_rank": 2}, r"tp_rank=2 of tp_size=2"),
        ({"expected": np.zeros(4, np.int32)}, r"expected must be a C-contiguous int64 array "
                                               r"of shape \(4,\), got dtype int32"),
        ({"next_expected": np.zeros(3, np.int64)}, r"next_expected must be .* shape \(3,\)"),
        ({"next_expected": np.zeros(8, np.int64)[::2]}, r"next_expected must be a C-cont"),
        ({"next_expected": frozen}, r"next_expected must be writeable"),
        ({"out": np.zeros(119, np.int32)}, r"at least 120 elements.* with 119 elements"),
        ({"out": np.zeros(120, np.int64)}, r"out must be .*int32.*got dtype int64"),
    ]:
        with pytest.raises(ValueError, match=match):
            cpp.direct_tables(**{**good, **change})


@pytest.mark.parametrize("num_local, num_chunks", [(1, 2), (4, 2), (3, 4), (64, 2), (8, 1)])
def test_local_expert_sort_index_is_megatrons_sort(num_local, num_chunks):
    """`sort_by_local_expert` (the C++ index, and its numpy twin) gives Megatron's unfused
    `sort_chunks_by_idxs` with the dispatcher's `sort_input_by_local_experts`, bit for
    bit, for rows and probs; zero-row chunks and experts included."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from megatron_overlap.megatron import dispatcher as d

    rng = np.random.default_rng(num_local * 10 + num_chunks)
    rows = rng.integers(0, 5, size=(num_local, num_chunks)) * (rng.random((num_local,
                                                                           num_chunks)) > 0.3)
    n = int(rows.sum())
    tokens = torch.randn(n, 6)
    probs = torch.rand(n)
    # Megatron's sort order (MoEAlltoAllTokenDispatcher.__init__): chunk-major in, expert-major out
    sorted_idxs = torch.arange(num_chunks * num_local).reshape(-1, num_local).T.ravel()
    want = sort_chunks_by_idxs(tokens, torch.from_numpy(rows.T.reshape(-1).copy()),
                               sorted_idxs, probs=probs)
    got = d.sort_by_local_expert(tokens, probs, rows)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    twin = np.empty(n, dtype=np.int32)
    d.local_expert_sort_index_numpy(rows, twin)
    native = np.empty(n, dtype=np.int32)
    cpp.local_expert_sort_index(rows, native)
    assert np.array_equal(twin, native)


def test_local_expert_sort_index_bad_input():
    rows = np.array([[1, 2], [0, 3]])
    with pytest.raises(ValueError, match=r"must be \[L, R\]"):
        cpp.local_expert_sort_index(rows.reshape(-1), np.empty(6, np.int32))
    with pytest.raises(ValueError, match="integer array"):
        cpp.local_expert_sort_index(rows.astype(np.float32), np.empty(6, np.int32))
    with pytest.raises(ValueError, match=r"in \[0, 2\^31\)"):
        cpp.local_expert_sort_index(-rows, np.empty(6, np.int32))
    with pytest.raises(ValueError, match="6 elements"):
        cpp.local_expert_sort_index(rows, np.empty(5, np.int32))
    with pytest.raises(ValueError, match="int32 array"):
        cpp.local_expert_sort_index(rows, np.empty(6, np.int64))
    with pytest.raises(ValueError, match=r"total must be < 2\^31"):
        cpp.local_expert_sort_index(np.full((2, 1), 2**30 + 1), np.empty(1, np.int32))


def test_megatron_splits_bad_input():
    """`megatron_splits` refuses counts of the wrong shape and an E that EP does not divide
    (and takes counts with extra columns, e.g. the reference path's slot columns)."""
    from megatron_overlap.metadata import megatron_splits

    counts = np.ones((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"expected \[R = 4, >= E\]"):
        megatron_splits(counts, tp_size=1, tp_rank=0, ep_size=4, ep_rank=0, num_experts=4)
    with pytest.raises(ValueError, match=r"expected \[R = 2, >= E\]"):
        megatron_splits(counts, tp_size=1, tp_rank=0, ep_size=2, ep_rank=0, num_experts=6)
    with pytest.raises(ValueError, match="positive multiple of ep_size"):
        megatron_splits(counts, tp_size=1, tp_rank=0, ep_size=2, ep_rank=0, num_experts=3)
    splits = megatron_splits(counts, tp_size=1, tp_rank=0, ep_size=2, ep_rank=1, num_experts=2)
    assert splits.input_splits.tolist() == [1, 1] and splits.output_splits.tolist() == [1, 1]
