"""launch/bench_waves.py on the CPU: the balanced routing map, the token counts that give
each expert whole row blocks, the wave fields of its rows, and its argument errors (the
timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_launch_bench_waves",
                                               REPO / "launch" / "bench_waves.py")
waves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(waves)


@pytest.mark.parametrize("experts, topk, blocks", [(8, 2, 26), (8, 2, 33), (16, 4, 5),
                                                   (1, 1, 1), (6, 3, 3)])
def test_every_expert_gets_the_same_whole_row_blocks(experts, topk, blocks):
    n = waves.tokens_for(blocks, experts, topk)
    m = waves.balanced_map(n, experts, topk)
    assert m.shape == (n, experts) and m.dtype == torch.bool
    assert m.sum(1).eq(topk).all()  # top-k distinct experts per token
    assert m.sum(0).tolist() == [waves.BM_UNIT * blocks] * experts


def test_the_rows_lay_out_as_the_op_sees_them():
    from megatron_overlap.bench.workloads import rank_rows

    m = waves.balanced_map(waves.tokens_for(3, 8, 2), 8, 2)
    meta = rank_rows([m], tp=1, ep=1, rank=0, topk=2).meta
    assert meta.tokens_per_local_expert.tolist() == [384] * 8


@pytest.mark.parametrize("tiles, grid, want", [
    (4096, 132, dict(waves=32, fill=0.0303)), (4224, 132, dict(waves=32, fill=1.0)),
    (1, 132, dict(waves=1, fill=0.0076)), (264, 132, dict(waves=2, fill=1.0))])
def test_wave_fields(tiles, grid, want):
    assert waves.wave_fields(tiles, grid) == want


@pytest.mark.parametrize("call, message", [
    (lambda: waves.balanced_map(10, 8, 2), "num_tokens=10"),
    (lambda: waves.balanced_map(16, 8, 9), "topk=9"),
    (lambda: waves.tokens_for(1, 8, 3), "row_blocks=1"),
    (lambda: waves.wave_fields(0, 132), "tiles=0"),
])
def test_bad_values_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("args, message", [
    (["--tiles", "bogus"], "tile variant 'bogus'"),
    (["--topk", "3", "--row-blocks", "1"], "row_blocks=1"),
    (["--iters", "0"], "--iters"),
    (["--experts", "2", "--topk", "4"], "--topk 4: expected 1..2"),
])
def test_bad_arguments_fail_before_any_gpu_work(args, message, tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    with pytest.raises(SystemExit) as exc:
        waves.main(["--out", str(out), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU refusal")
def test_without_a_gpu_it_exits_2_and_makes_no_folder(tmp_path, capsys):
    out = tmp_path / "new" / "w.jsonl"
    assert waves.main(["--out", str(out)]) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err
    assert not out.parent.exists()
