"""`megatron_overlap._host.current_stream` on a GPU: always the stream torch calls current,
across stream switches, new streams and external streams; the Triton scratch, the host
harness and the flag-on dispatcher's sort by local expert on the GPU. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_current_stream_follows_torch():
    from megatron_overlap._host import current_stream

    device = torch.device("cuda", torch.cuda.current_device())

    def check():
        want = torch.cuda.current_stream(device)
        for got in (current_stream(device), current_stream(device.index), current_stream(None)):
            assert got == want and got.cuda_stream == want.cuda_stream, (got, want)

    check()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        check()
        nested = torch.cuda.Stream(device)
        with torch.cuda.stream(nested):
            check()
            # the same CUDA stream under another torch identity, straight after it
            external = torch.cuda.ExternalStream(nested.cuda_stream, device=device)
            with torch.cuda.stream(external):
                check()
            check()
        check()
    check()
    # many short-lived streams: the pool hands the same handles out again; still equal
    for _ in range(40):
        s = torch.cuda.Stream(device)
        with torch.cuda.stream(s):
            check()
    check()


def test_triton_scratch_on_gpu():
    from megatron_overlap._host import own_launch, triton_scratch

    stream = torch.cuda.current_stream().cuda_stream
    with own_launch():
        a = triton_scratch(4096, 128, stream)
        assert a.is_cuda and a.dtype == torch.int8 and a.numel() >= 4096
        assert triton_scratch(1024, 128, stream) is a
        side = torch.cuda.Stream()
        assert triton_scratch(1024, 128, side.cuda_stream) is not a
    assert triton_scratch(1024, 128, stream) is not a  # not our launch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), own_launch():  # captured: not the kept buffer
        assert triton_scratch(1024, 128, torch.cuda.current_stream().cuda_stream) is not a


def test_bench_host_gpu_times_a_combine_call(tmp_path):
    """`launch/bench_host.py --gpu`: every variant's combine call and the finalize launch,
    one row each (a small Qwen1.5-MoE call, 2 rounds)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / "bench_host.py"
    spec = importlib.util.spec_from_file_location("bench_host", path)
    bench_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_host)
    out = tmp_path / "host.jsonl"
    assert bench_host.main(["--gpu", "--model", "qwen1.5-moe-a2.7b", "--tokens", "256",
                            "--rounds", "2", "--thrash-mib", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == [n for n, _ in bench_host.GPU_VARIANTS] + [
        "finalize launch"]
    assert all(r["cold_us"] > 0 and r["ep"] == 1 and r["gpu"] != "cpu" for r in rows)


def test_sort_by_local_expert_on_gpu():
    """The dispatcher's sort by local expert on CUDA (index built in pinned memory, copied,
    one `index_select` per tensor) is Megatron's unfused `sort_chunks_by_idxs` bit for bit,
    also for 20 calls queued back to back behind a ~0.5 s GPU sleep, so that every index
    copy is still pending when the next call fills its pinned index (a version that reused
    one pinned buffer failed this way with an out-of-bounds index; review of v5.7)."""
    import numpy as np
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from megatron_overlap.megatron.dispatcher import sort_by_local_expert

    rng = np.random.default_rng(0)
    got, want = [], []
    tiny = torch.zeros(4, 8, device="cuda")
    sort_by_local_expert(tiny, tiny[:, 0], np.array([[1, 1], [2, 0]]))  # kernels warm
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))  # the calls below queue behind this
    for call in range(20):
        num_local, num_chunks = (64, 2) if call % 2 else (30, 4)
        rows = rng.integers(0, 200, size=(num_local, num_chunks))
        n = int(rows.sum())
        tokens = torch.randn(n, 512, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(n, device="cuda")
        order = torch.arange(num_chunks * num_local).reshape(-1, num_local).T.ravel()
        want.append(sort_chunks_by_idxs(tokens, torch.from_numpy(rows.T.reshape(-1).copy()),
                                        order, probs=probs))
        got.append(sort_by_local_expert(tokens, probs, rows))
    torch.cuda.synchronize()
    for call, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]), call
