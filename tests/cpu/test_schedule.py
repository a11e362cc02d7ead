"""The fused kernel's host-side schedule and the benchmark report, on the CPU.

The queue order is what makes the persistent kernel deadlock-free: a gather item may only
wait for GEMM2 tiles that come before it in the queue (they are claimed, hence running, by
the time any CTA claims the item). These tests check that, and that the tiles cover every
(row, column block) exactly once and the items every slot exactly once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_overlap.bench import report
from megatron_overlap.bench.workloads import rank_rows, routing_maps
from megatron_overlap.ops.triton_gemm2_gatherrs import build_schedule, split_columns

LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)]


@pytest.mark.parametrize("tp,ep", LAYOUTS)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "sparse"])
def test_schedule_covers_everything_in_a_safe_order(tp, ep, routing):
    hidden, bm, bn = 300, 16, 32
    r = tp * ep
    maps = routing_maps([37 + 11 * g for g in range(r)], 4 * ep, 2, routing, seed=3)
    for rank in range(r):
        meta = rank_rows(maps, tp=tp, ep=ep, rank=rank, topk=2).meta
        sched = build_schedule(meta, hidden, bm, bn, slots_per_item=8)
        entries, segs, items = sched.entries, sched.segments, sched.items
        tiles = entries[entries[:, 0] >= 0]
        n_rows = int(meta.tokens_per_local_expert.sum())
        # Every (row, column block) exactly once; tiles stay within one expert's rows.
        cover = np.zeros((n_rows, -(-hidden // bn)), dtype=int)
        starts = np.concatenate([[0], np.cumsum(meta.tokens_per_local_expert)])
        for expert, r0, r1, n0, _ in tiles:
            assert starts[expert] <= r0 < r1 <= starts[expert + 1]
            assert r1 - r0 <= bm
            cover[r0:r1, n0 // bn] += 1
        assert (cover == 1).all()
        # Segment bookkeeping: expected tiles, one segment per (destination, split).
        splits, _ = split_columns(hidden, bn)
        assert sched.splits == splits and len(segs) == r * splits
        pairs = {(int(g), int(c)) for g, c in segs[:, :2]}
        assert len(pairs) == len(segs) and {g for g, _ in pairs} == set(range(r))
        for seg in range(len(segs)):
            assert (tiles[:, 4] == seg).sum() == segs[seg, 2]
        # Remote destinations first, this rank's own segments last.
        assert (segs[-splits:, 0] == rank).all() and (segs[:-splits, 0] != rank).all()
        # Items cover each segment's slots exactly once, and come after its last tile.
        position = {}
        for pos, (kind, ref, *_rest) in enumerate(entries):
            if kind < 0:
                position[ref] = pos
        last_tile = {seg: np.nonzero((entries[:, 0] >= 0) & (entries[:, 4] == seg))[0].max(
            initial=-1) for seg in range(len(segs))}
        for seg in range(len(segs)):
            mine = np.nonzero(items[:, 0] == seg)[0]
            assert len(mine) >= 1 and (items[mine, 3] == len(mine)).all()
            got = np.zeros(segs[seg, 4], dtype=int)
            for i in mine:
                got[items[i, 1] : items[i, 2]] += 1
                assert position[i] > last_tile[seg]
            assert (got == 1).all()


def test_split_columns():
    assert split_columns(4096, 128) == (4, 1024)
    assert split_columns(2048, 128) == (2, 1024)
    assert split_columns(40, 16) == (1, 48)
    splits, width = split_columns(5000, 128)
    assert width % 128 == 0 and splits * width >= 5000 > (splits - 1) * width


def test_report_table_and_plot(tmp_path):
    rows = []
    for provider, ms in [("gemm", 1.0), ("megatron", 2.0), ("prereduced", 1.6), ("ours", 1.25),
                         ("ours_nocomm", 1.1), ("bound", 1.0)]:
        rows.append(dict(model="m", tokens_per_rank=4096, layout="ep2", provider=provider,
                         p50_ms=ms))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    text = report.table(report.load_rows(str(path)))
    expected = ("| m | 4096 | ep2 | 1.000 | 2.000 | 1.600 | 1.250 | 1.100 | 1.000 | 1.60 | 1.28 | "
                "1.25 | 0.91 | - | - |")
    assert expected in text, text
    pytest.importorskip("matplotlib")
    report.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
