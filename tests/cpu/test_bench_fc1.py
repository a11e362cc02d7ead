"""launch/bench_fc1.py on the CPU: rows, chunk counts, the agreement check, bad arguments."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("bench_fc1", ROOT / "launch" / "bench_fc1.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_fc1_rows(tmp_path, capsys):
    out = tmp_path / "sub" / "fc1.jsonl"
    assert _module().main(["--model", "tiny", "--tokens", "48", "--chunk-mb", "all", "0.004",
                           "split:all", "split:0.004", "--iters", "2", "--warmup", "0",
                           "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["chunk_mb"]) for r in rows] == [
        ("rows", None), ("rows", 0.004), ("split", None), ("split", 0.004)], rows
    # tiny: 4 local experts at EP 2, 96 rows of 2 x 32 fp32 FC1 outputs (256 B a row):
    # 0.004 MiB = 16 rows a chunk of [rows, 2F], 32 rows of [rows, F] (split)
    assert all(r["rows"] == 96 and r["local_experts"] == 4 for r in rows), rows
    assert [r["chunks"] for r in rows] == [1, 6, 1, 3], rows
    assert rows[0]["vs_first"] == 1.0 and all(r["agree"] for r in rows), rows
    assert all(r["peak_extra_bytes"] is None and r["ms_p50"] > 0 for r in rows), rows
    text = capsys.readouterr().out
    assert "rows  0.004 MiB x  6" in text and "split 0.004 MiB x  3" in text, text


@pytest.mark.parametrize("argv, message", [
    (["--chunk-mb", "0"], "expected [rows:|split:] then 'all' or a number of MiB > 0"),
    (["--chunk-mb", "inf"], "expected [rows:|split:] then 'all' or a number of MiB > 0"),
    (["--chunk-mb", "cols:64"], "the mode before ':' must be 'rows' or 'split'"),
    (["--chunk-mb", ":64"], "the mode before ':' must be 'rows' or 'split'"),
    (["--chunk-mb", "1e308"], "a number of MiB > 0 and <= 1073741824"),
    (["--tokens", "5000", "--chunk-mb", "1e-9"], "makes 10000 chunks of tiny's 10000 rows"),
    (["--model", "mixtral-8x7b", "--ep", "3"], "does not divide mixtral-8x7b's 8 experts"),
    (["--model", "no-such-model"], "no-such-model"),
])
def test_bench_fc1_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        _module().main(argv + ["--out", ""])
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_bench_fc1_exits_1_when_a_chunk_size_disagrees(tmp_path, capsys):
    mod = _module()
    real = mod.swiglu_fc1_chunks

    def broken(x, w1, chunks, probs):  # wrong values whenever the rows run in chunks
        h, impl = real(x, w1, chunks, probs)
        return (h + 1.0 if len(chunks) > 1 else h), impl

    mod.swiglu_fc1_chunks = broken
    out = tmp_path / "fc1.jsonl"
    assert mod.main(["--tokens", "48", "--chunk-mb", "all", "0.004", "--iters", "1",
                     "--warmup", "0", "--out", str(out)]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["agree"] for r in rows] == [True, False], rows
    assert "disagrees with the first setting" in capsys.readouterr().err
