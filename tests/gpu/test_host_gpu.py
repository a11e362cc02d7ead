"""`megatron_overlap._host.current_stream` on a GPU: always the stream torch calls current,
across stream switches, new streams and external streams. Skipped without CUDA."""

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
        check()
        external = torch.cuda.ExternalStream(nested.cuda_stream, device=device)
        with torch.cuda.stream(external):
            check()
    check()
    # many short-lived streams: the pool hands the same handles out again; still equal
    for _ in range(40):
        s = torch.cuda.Stream(device)
        with torch.cuda.stream(s):
            check()
    check()
