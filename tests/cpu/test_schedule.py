"""The fused kernel's host-side tables and the benchmark report, on the CPU.

The tile list and the receive layout are what the kernels trust blindly: these tests check
that the tiles cover every (row, column block) exactly once, that every sender's tiles land
each (token, expert) row exactly where the receiver's finalize index looks for it, that the
arrival counts match the tiles sent, and that the wave order keeps k remote tiles per wave.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_overlap.bench import report
from megatron_overlap.bench.workloads import rank_rows, routing_maps
from megatron_overlap.ops.triton_gemm2_gatherrs import (
    direct_layout,
    contribution_rows,
    wave_order,
)

LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)]


@pytest.mark.parametrize("tp,ep", LAYOUTS + [(2, 4), (4, 2)])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "sparse"])
def test_tiles_land_where_the_finalize_reads(tp, ep, routing):
    hidden, bm, bn = 300, 16, 32
    r = tp * ep
    num_experts, topk = 4 * ep, 2
    tokens = [37 + 11 * g for g in range(r)]
    if routing == "sparse" and r > 1:
        tokens[-1] = 0  # a rank without tokens: it receives nothing, its block is empty
    maps = routing_maps(tokens, num_experts, topk, routing, seed=3)
    layouts, all_rows = [], []
    for rank in range(r):
        rows = rank_rows(maps, tp=tp, ep=ep, rank=rank, topk=topk)
        lay = direct_layout(rows.meta, hidden, bm, bn)
        layouts.append(lay)
        all_rows.append(rows)
    # Simulated receive buffers: (sender, source token, global expert) of every stored row.
    recv = [dict() for _ in range(r)]
    for s, (lay, rows) in enumerate(zip(layouts, all_rows)):
        meta = rows.meta
        tiles = np.concatenate([lay.tiles_remote, lay.tiles_local])
        assert (lay.tiles_remote[:, 4] != s).all() and (lay.tiles_local[:, 4] == s).all()
        n_rows = int(meta.tokens_per_local_expert.sum())
        cover = np.zeros((n_rows, -(-hidden // bn)), dtype=int)
        starts = np.concatenate([[0], np.cumsum(meta.tokens_per_local_expert)])
        for expert, r0, r1, n0, dest, drow in tiles:
            assert starts[expert] <= r0 < r1 <= starts[expert + 1] and r1 - r0 <= bm
            assert (rows.row_source[r0:r1] == dest).all()  # one source chunk per tile
            cover[r0:r1, n0 // bn] += 1
            # Another rank's rows go into its receive buffer; this rank's own into the
            # call's local buffer, which the finalize addresses after the receive buffer.
            if dest == s:
                assert drow + (r1 - r0) <= lay.local_rows
                first = int(drow) + int(lay.recv_rows[s])
            else:
                assert drow + (r1 - r0) <= layouts[dest].recv_rows[dest]
                first = int(drow)
            for i in range(r1 - r0):
                key = (first + i, int(n0))
                ident = (s, int(rows.row_token[r0 + i]),
                         int(meta.ep_rank * meta.num_local_experts + expert))
                assert recv[dest].setdefault(key, ident) == ident, "two rows, one place"
        assert (cover == 1).all()
        # The local buffer's rows: exactly this rank's rows for its own tokens.
        assert lay.local_rows == int(sum(r1 - r0 for _, r0, r1, n0, d, _ in tiles
                                         if d == s and n0 == 0))
        # Arrivals: what every sender stores here, counted by the receiver.
        for g in range(r):
            sent = int((tiles[:, 4] == g).sum()) if g != s else 0
            assert layouts[g].arrivals[s] == sent
    # Every rank's receive buffer and then its local buffer are filled densely.
    for g, lay in enumerate(layouts):
        used = sorted(row for row, n0 in recv[g] if n0 == 0)
        assert used == list(range(int(lay.recv_rows[g]) + lay.local_rows))
    # The finalize index of every rank reads exactly its own pairs, once per TP sender.
    for g, (lay, rows) in enumerate(zip(layouts, all_rows)):
        index = contribution_rows(rows.meta, lay)  # [T, E, TP]
        token_of, expert_of = maps[g].nonzero(as_tuple=True)
        want = sorted((int(t), int(e), ep_tp) for t, e in zip(token_of, expert_of)
                      for ep_tp in range(tp))
        got = []
        for t, e, ep_tp in (index >= 0).nonzero().tolist():
            s, tok, expert = recv[g][(int(index[t, e, ep_tp]), 0)]
            assert (tok, expert, s % tp, s // tp) == (t, e, ep_tp, e // (num_experts // ep))
            got.append((t, e, ep_tp))
        assert sorted(got) == want


@pytest.mark.parametrize("num_remote,num_local,grid,k", [
    (10, 30, 8, 2), (30, 10, 8, 6), (0, 5, 4, 1), (5, 0, 4, 1), (7, 7, 1, 1), (9, 20, 4, 9)])
def test_wave_order(num_remote, num_local, grid, k):
    order = wave_order(num_remote, num_local, grid, k)
    assert sorted(order.tolist()) == list(range(num_remote + num_local))
    is_remote = order < num_remote
    kc = min(max(k, 1), grid - 1) if grid > 1 else grid
    for w in range(0, len(order), grid):
        wave = is_remote[w : w + grid]
        left_r, left_l = is_remote[w:].sum(), (~is_remote[w:]).sum()
        if grid > 1 and left_r >= kc and left_l >= grid - kc and len(wave) == grid:
            assert wave.sum() == kc, (w, wave)
    # Within each kind, the original order is kept (remote destinations round-robin).
    assert (np.diff(order[is_remote]) > 0).all() and (np.diff(order[~is_remote]) > 0).all()


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
    # with both modes timed: the auto column takes the resource manager's mode (auto_mode)
    extra = [dict(model="m", tokens_per_rank=4096, layout="ep2", provider=p, p50_ms=ms,
                  auto_mode="prereduce")
             for p, ms in [("ours_prepared", 1.2), ("ours_prereduced", 1.0), ("ours_auto", 1.0)]]
    path.write_text("\n".join(json.dumps(r) for r in rows + extra))
    text = report.table(report.load_rows(str(path)))
    assert "| - | - | 1.200 | 1.000 | prereduce | 2.00 | 1.60 | 1.00 |" in text, text
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(empty)])
    assert exit_info.value.code == 2
    pytest.importorskip("matplotlib")
    report.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert report.main([str(path), "--plot", str(tmp_path / "new" / "q.png")]) == 0
    assert (tmp_path / "new" / "q.png").stat().st_size > 1000


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1), (2, 2)])
def test_slot_free_metadata_gives_the_same_layout(tp, ep):
    """The dispatcher builds metadata without slots when the Triton path runs: the Triton
    layout must not change, and the reference path must refuse it."""
    import torch

    from megatron_overlap.metadata import build_metadata
    from megatron_overlap.reference import gemm2_gatherrs_reference

    r = tp * ep
    maps = routing_maps([29 + 5 * g for g in range(r)], 4 * ep, 2, "skewed", seed=1)
    for rank in range(r):
        full = rank_rows(maps, tp=tp, ep=ep, rank=rank, topk=2).meta
        lite = build_metadata(
            counts=np.concatenate([full.routed_counts, np.zeros((r, ep), np.int64)], axis=1),
            row_slot=None, dest_token_mask=None, tp_size=tp, tp_rank=rank % tp, ep_size=ep,
            ep_rank=rank // tp, topk=2, routing_map=maps[rank])
        a, b = direct_layout(full, 64, 16, 32), direct_layout(lite, 64, 16, 32)
        for field in ("tiles_remote", "tiles_local", "arrivals", "recv_rows", "local_rows",
                      "finalize_base"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert lite.gather_index is None and lite.num_tokens == maps[rank].shape[0]
        h = torch.zeros(int(lite.tokens_per_local_expert.sum()), 8)
        with pytest.raises(ValueError, match="Triton backend only"):
            gemm2_gatherrs_reference(h, torch.zeros(lite.num_local_experts, 64, 8), lite, None)
    with pytest.raises(ValueError, match="needs the routing_map"):
        build_metadata(counts=np.zeros((1, 3), np.int64), row_slot=None, dest_token_mask=None,
                       tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, topk=1)


def test_compiled_kernel_resources_feed_the_plan():
    """The resource manager's occupancy input comes from the compiled kernel once it ran."""
    from types import SimpleNamespace

    import torch

    from megatron_overlap.ops import triton_gemm2_gatherrs as op
    from megatron_overlap.resource import KernelResources

    index = op.gemm_index_key(1, 8, 128)
    assert index == (1, 8, 128)
    assert op.gemm_index_key(2, None, 60) == (2, 60, 64)  # no top-k: every expert a slot
    assert op.gemm_index_key(1, 8, 256) == op._PLACEHOLDER_INDEX  # index alone above 128
    key = (torch.bfloat16, 777, 333, op.DEFAULT_TILE, index)
    op._RESOURCES.pop(key, None)
    assert op.compiled_resources(torch.bfloat16, 777, 333, index=index) is None
    op._record_resources(key, object())  # not a compiled kernel (the interpreter): ignored
    assert op.compiled_resources(torch.bfloat16, 777, 333, index=index) is None
    handle = SimpleNamespace(n_regs=168, metadata=SimpleNamespace(shared=147480, num_warps=8))
    op._record_resources(key, handle)
    want = KernelResources(168, 147480, 256)
    assert op.compiled_resources(torch.bfloat16, 777, 333, index=index) == want
    # another index specialisation of the same shape is another compiled kernel
    assert op.compiled_resources(torch.bfloat16, 777, 333, index=(1, 6, 64)) is None
    assert op.compiled_resources(torch.bfloat16, 777, 333) == want  # any specialisation
    assert op.call_resources(torch.bfloat16, 777, 333, 1, 8, 128) == want  # as a call asks
    assert op.call_resources(torch.bfloat16, 777, 333, 1, 6, 64) is None
    op._RESOURCES.pop(key)


@pytest.mark.parametrize("value, expected", [("", None), ("0", False), ("1", True),
                                             ("yes", "refused"), ("true", "refused"),
                                             (" 1", "refused")])
def test_tma_store_variable_picks_the_gpu_default_tile(monkeypatch, value, expected):
    """$MEGATRON_OVERLAP_TMA_STORE: the GPU's default tile stores through TMA descriptors
    ("1") or from registers ("0"); unset, through TMA for a group of at most
    `TMA_STORE_DEFAULT_MAX_WORLD` (1) ranks and from registers for larger groups. Anything
    else is refused, naming the variable. The interpreter's tile never changes."""
    import torch

    from megatron_overlap import config
    from megatron_overlap.ops import triton_gemm2_gatherrs as op

    monkeypatch.setenv(config.TMA_STORE_ENV, value)
    if expected == "refused":
        with pytest.raises(ValueError, match=f"MEGATRON_OVERLAP_TMA_STORE={value!r}"):
            op.default_tile(torch.device("cuda"), 1)
        with pytest.raises(ValueError, match=f"MEGATRON_OVERLAP_TMA_STORE={value!r}"):
            op.default_tile(torch.device("cpu"), 1)  # refused on every device alike
        return
    assert config.TMA_STORE_DEFAULT_MAX_WORLD == 1
    for world in (1, 2, 4, 8):
        want = expected if expected is not None else world <= 1
        tile = op.default_tile(torch.device("cuda"), world)
        assert tile.tma_store is want
        assert tile == (op.DEFAULT_TMA_TILE if want else op.DEFAULT_TILE)
        settings = config.fused_path_settings(world)
        assert settings["tma_store"] is want and settings["tma_store_env"] == value
        # where no GPU kernel runs (the CPU, the reference backend) no TMA epilogue ran,
        # nor for rows of a size TMA cannot store (the register fallback)
        assert config.fused_path_settings(world, triton_gpu=False)["tma_store"] is False
        assert config.fused_path_settings(world, row_bytes=2008)["tma_store"] is False
        assert config.fused_path_settings(world, row_bytes=4096)["tma_store"] is want
        assert op.default_tile(torch.device("cpu"), world) == op.INTERPRETER_TILE


@pytest.mark.parametrize("world, error", [(0, ValueError), (-2, ValueError),
                                          (1.0, TypeError), (True, TypeError),
                                          (None, TypeError)])
def test_default_tile_refuses_a_bad_world_size(world, error):
    import torch

    from megatron_overlap.config import tma_store_enabled
    from megatron_overlap.ops import triton_gemm2_gatherrs as op

    with pytest.raises(error, match=f"world_size={world!r}"):
        op.default_tile(torch.device("cuda"), world)
    with pytest.raises(error, match=f"world_size={world!r}"):
        tma_store_enabled(world)


def test_tile_config_refuses_tma_store_and_rotate_without_the_static_schedule():
    """The TMA-store epilogue does not compile in the dynamic schedule's loop (Triton 3.6),
    and the rotation is a static-schedule permutation: both need static=True."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import TileConfig

    for fields in (dict(tma_store=True), dict(rotate=True), dict(tma_store=True, rotate=True)):
        with pytest.raises(ValueError, match="need the static schedule"):
            TileConfig(static=False, **fields)
        assert TileConfig(**fields).static  # (static by default)
    TileConfig(static=False)  # the dynamic schedule alone stays valid


@pytest.mark.parametrize("fields, message", [
    (dict(bm=8), "bm=8 must be a power of two in"), (dict(bn=512), "bn=512 must be"),
    (dict(bk=48), "bk=48 must be"), (dict(num_warps=3), "num_warps=3 must be"),
    (dict(num_warps=0), "num_warps=0 must be"), (dict(num_stages=0), "num_stages=0 must be"),
])
def test_tile_config_refuses_sizes_no_launch_takes(fields, message):
    from megatron_overlap.ops.triton_gemm2_gatherrs import TileConfig

    with pytest.raises(ValueError, match=message):
        TileConfig(**fields)


@pytest.mark.parametrize("name, value, expected", [
    ("HOST_TABLES", "", "fused"), ("HOST_TABLES", "fused", "fused"),
    ("HOST_TABLES", "steps", "steps"), ("HOST_TABLES", "cpp", None),
    ("HOST_TABLES", "Fused", None),
    ("HOST_CACHE", "", True), ("HOST_CACHE", "1", True), ("HOST_CACHE", "0", False),
    ("HOST_CACHE", "yes", None), ("HOST_CACHE", "off", None),
    ("HOST_SPLITS", "", True), ("HOST_SPLITS", "1", True), ("HOST_SPLITS", "0", False),
    ("HOST_SPLITS", "true", None),
])
def test_host_path_variables(monkeypatch, name, value, expected):
    """$MEGATRON_OVERLAP_HOST_TABLES: "fused" (default) or "steps"; $MEGATRON_OVERLAP_
    HOST_CACHE and $MEGATRON_OVERLAP_HOST_SPLITS: "1" (default) or "0". Anything else is refused by the variable's reader and
    by `check_environment` (the dispatcher's construction), naming the variable;
    `fused_path_settings` records the value read."""
    from megatron_overlap import config

    var, read, accepted = {
        "HOST_TABLES": (config.HOST_TABLES_ENV, config.host_tables_mode, "'fused' or 'steps'"),
        "HOST_CACHE": (config.HOST_CACHE_ENV, config.host_cache_enabled, "'0' or '1'"),
        "HOST_SPLITS": (config.HOST_SPLITS_ENV, config.host_splits_enabled, "'0' or '1'"),
    }[name]
    monkeypatch.setenv(var, value)
    if expected is None:
        for check in (read, config.check_environment):
            with pytest.raises(ValueError, match=f"{var}={value!r}: expected {accepted}"):
                check()
        return
    assert read() == expected
    assert config.fused_path_settings(1)[name.lower()] == expected
    config.check_environment()


def test_unknown_variables_warn_once_with_the_closest_name(monkeypatch):
    """A set `MEGATRON_OVERLAP_*` name the package does not read (a misspelling) gets one
    UserWarning from `check_environment` naming it and the closest known variable; the ten
    known ones warn nothing; every `MEGATRON_OVERLAP_*` literal in the package's source is a
    known variable (a new variable must be added to `environment_variables`)."""
    import pathlib
    import re
    import warnings

    from megatron_overlap import config

    pkg = pathlib.Path(config.__file__).parent
    used = {m for f in pkg.rglob("*.py")
            for m in re.findall(r"MEGATRON_OVERLAP_[A-Z0-9_]+", f.read_text())}
    known = set(config.environment_variables())
    assert used == known, used ^ known
    for name in list(__import__("os").environ):
        if name.startswith(config.ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setattr(config, "_warned_unknown", set())
    monkeypatch.setenv(config.TMA_STORE_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.check_environment()
    monkeypatch.setenv("MEGATRON_OVERLAP_TMASTORE", "0")
    monkeypatch.setenv("MEGATRON_OVERLAP_XYZ", "1")
    assert config.unknown_variables() == [("MEGATRON_OVERLAP_TMASTORE", config.TMA_STORE_ENV),
                                          ("MEGATRON_OVERLAP_XYZ", None)]
    with pytest.warns(UserWarning) as got:
        config.check_environment()
    text = [str(w.message) for w in got if "not a variable of megatron_overlap" in str(w.message)]
    assert len(text) == 2
    assert "$MEGATRON_OVERLAP_TMASTORE" in text[0] and "did you mean MEGATRON_OVERLAP_TMA_STORE" in text[0]
    assert "$MEGATRON_OVERLAP_XYZ" in text[1] and "did you mean" not in text[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.check_environment()  # once per process


def test_workspace_spare_arrivals():
    """`spare_arrivals` / `take_arrivals`: the running totals swap between two arrays (no
    allocation per call); only the spare is taken; a resized totals array (as
    `local_workspaces` sets) gets a spare of its own shape."""
    import numpy as np
    import torch

    from megatron_overlap.symm import GatherRSWorkspace

    ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
    first = ws.expected_arrivals
    spare = ws.spare_arrivals()
    assert spare is not first and spare.shape == first.shape and spare.dtype == np.int64
    assert ws.spare_arrivals() is spare  # the same until taken
    spare[:] = 5
    ws.take_arrivals(spare)
    assert ws.expected_arrivals is spare and ws.spare_arrivals() is first
    with pytest.raises(ValueError, match="takes the array spare_arrivals returned"):
        ws.take_arrivals(np.zeros_like(spare))
    ws.expected_arrivals = np.zeros(3, dtype=np.int64)
    assert ws.spare_arrivals().shape == (3,)
    ws.destroy()
    with pytest.raises(RuntimeError):
        ws.take_arrivals(ws.spare_arrivals())
