"""scripts/ab_trees.sh on the CPU: a commit's sources exported next to the working tree,
then the layer benchmark of both trees interleaved (tiny model, one process), and bad usage.
Timings of a CPU run mean nothing; what is checked is that each tree's own code ran and
wrote its rows, and the summary."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "ab_trees.sh"


def _git_head():
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _run(tmp_path, *args, timeout=300):
    # OUT relative to the working folder: the script resolves it before entering the trees
    env = dict(os.environ, AB_DIR=str(tmp_path / "ab"), OUT="out", OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)


def test_prepare_and_run_two_trees(tmp_path):
    head = _git_head()
    if head is None:
        pytest.skip("needs a git checkout")
    proc = _run(tmp_path, "prepare", "HEAD")
    assert proc.returncode == 0, proc.stderr
    tree = tmp_path / "ab" / "HEAD"
    assert (tree / "AB_COMMIT").read_text().strip() == head
    assert (tree / "launch" / "bench_layer.py").is_file() and not (tree / "docs").exists()
    # the prepared tree's copy of the package is the one its run imports: mark it
    init = tree / "megatron_overlap" / "__init__.py"
    init.write_text(init.read_text() + "\nprint('AB-TREE-COPY-IMPORTED')\n")
    # rows of an earlier call in the same OUT are not this call's rounds
    (tmp_path / "out" / "ab").mkdir(parents=True)
    (tmp_path / "out" / "ab" / "HEAD.jsonl").write_text('{"stale": true}\n')
    proc = _run(tmp_path, "run", "--rounds", "1", "--nproc", "1", str(tree), str(REPO), "--",
                "--device", "cpu", "--model", "tiny", "--seq-lengths", "32", "--warmup", "1",
                "--iters", "2", "--baselines", "off-grouped")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out" / "ab"
    rows = {name: [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
            for name in ("HEAD", REPO.name)}
    for name, got in rows.items():
        assert sorted(r["variant"] for r in got) == ["off", "off-grouped", "on"], name
        assert all(r["agree"] for r in got), name
    assert {r["git_sha"] for r in rows["HEAD"]} == {head}
    assert "AB-TREE-COPY-IMPORTED" in (out / "HEAD_r1.log").read_text()
    assert "AB-TREE-COPY-IMPORTED" not in (out / f"{REPO.name}_r1.log").read_text()
    assert "[HEAD r1] layer tiny tp1/ep1/dp1/sp0 seq 32:" in proc.stdout
    assert "p50 ms per round" in proc.stdout
    assert "tiny tp1/ep1/dp1/sp0 32 off-grouped" in proc.stdout


def test_bad_usage_exits_2(tmp_path):
    # nothing is prepared when one of the commits is bad
    assert _run(tmp_path, "prepare", "HEAD", "no-such-commit-xyz").returncode == 2
    assert not (tmp_path / "ab" / "HEAD").exists()
    proc = _run(tmp_path, "run", str(tmp_path), "--", "--device", "cpu")
    assert proc.returncode == 2 and "has no launch/bench_layer.py" in proc.stderr
    assert _run(tmp_path, "run", "--rounds", "0", str(REPO)).returncode == 2
    for option in ("--rounds", "--nproc"):  # no value: an error, not an endless loop
        proc = _run(tmp_path, "run", option, timeout=30)
        assert proc.returncode == 2 and "takes a positive integer" in proc.stderr
    proc = _run(tmp_path, "run", str(REPO), "--device", "cpu")  # the `--` forgotten
    assert proc.returncode == 2 and "options after '--'" in proc.stderr
    proc = _run(tmp_path, "run", str(REPO), str(REPO), "--", "--device", "cpu")
    assert proc.returncode == 2 and "two trees are named" in proc.stderr
    assert _run(tmp_path).returncode == 2
