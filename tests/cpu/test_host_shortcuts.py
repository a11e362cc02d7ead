"""`megatron_overlap._host`: the environment reader, the current-stream cache and the
Triton scratch cache give what the plain calls give (the CUDA calls stood in for here; on a
GPU in tests/gpu/test_host_gpu.py), and $MEGATRON_OVERLAP_HOST_CACHE turns them off (its
values: tests/cpu/test_schedule.py)."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from megatron_overlap import _host

NAME = "MEGATRON_OVERLAP_TEST_HOST_VARIABLE"


@pytest.mark.parametrize("cache", ["", "0", "1"])
def test_getenv_reads_what_os_environ_reads(monkeypatch, cache):
    monkeypatch.setenv(_host.HOST_CACHE_ENV, cache)
    monkeypatch.delenv(NAME, raising=False)
    assert _host.getenv(NAME) is None
    assert _host.getenv(NAME, "dflt") == "dflt"
    for value in ("", "device", "1", "caf\u00e9", "a=b c"):
        monkeypatch.setenv(NAME, value)
        assert _host.getenv(NAME, "dflt") == os.environ.get(NAME, "dflt") == value
    with mock.patch.dict(os.environ, {NAME: "patched"}):
        assert _host.getenv(NAME) == "patched"
    assert _host.getenv(NAME) == "a=b c"  # the patch undone
    monkeypatch.delenv(NAME)
    assert _host.getenv(NAME, "gone") == "gone"
    with pytest.raises(TypeError):
        _host.getenv(b"MEGATRON_OVERLAP_TILE_LIST")  # as os.environ.get refuses bytes


class _FakeCuda:
    """Stand-ins for torch's current-stream calls: `raw[device]` is the current raw handle;
    `current_stream` returns a new object per call, as torch does."""

    def __init__(self):
        self.raw = {0: 0, 1: 0}
        self.made = 0

    def raw_stream(self, index):
        return self.raw[index]

    def current_stream(self, index=None):
        self.made += 1
        return ("stream", index, self.raw[index], self.made)


def test_current_stream_is_cached_by_raw_handle(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(_host, "_RAW_STREAM", fake.raw_stream)
    monkeypatch.setattr(_host, "_STREAMS", {})
    monkeypatch.setattr(_host.torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(_host.torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv(_host.HOST_CACHE_ENV, raising=False)
    device0 = _host.torch.device("cuda", 0)
    first = _host.current_stream(device0)
    assert _host.current_stream(device0) is first and _host.current_stream(0) is first
    fake.raw[0] = 0x7F00  # another stream made current on device 0
    second = _host.current_stream(device0)
    assert second is not first and second[2] == 0x7F00
    assert _host.current_stream(device0) is second
    fake.raw[0] = 0  # back to the default stream: a fresh object for it
    third = _host.current_stream(device0)
    assert third[2] == 0 and _host.current_stream(device0) is third
    # None and a device without an index: the current device (1 here), cached apart
    other = _host.current_stream(None)
    assert other[1] == 1 and _host.current_stream(_host.torch.device("cuda")) is other
    assert _host.current_stream(device0) is third
    # turned off: the plain call every time
    monkeypatch.setenv(_host.HOST_CACHE_ENV, "0")
    made = fake.made
    assert _host.current_stream(device0) is not _host.current_stream(device0)
    assert fake.made == made + 2


def test_triton_scratch_is_kept_per_device_and_stream(monkeypatch):
    """One buffer per (device, raw stream), grown when a launch asks for more; a fresh one
    per launch with the cache off or an alignment beyond the caching allocator's."""
    made = []

    class Buf:
        def __init__(self, size):
            self.size = size
            made.append(self)

        def numel(self):
            return self.size

    device = [0]
    monkeypatch.setattr(_host, "_SCRATCH", {})
    monkeypatch.setattr(_host.torch, "empty", lambda size, dtype=None, device=None: Buf(size))
    monkeypatch.setattr(_host.torch.cuda, "current_device", lambda: device[0])
    monkeypatch.delenv(_host.HOST_CACHE_ENV, raising=False)
    a = _host.triton_scratch(4096, 128, 0)
    assert _host.triton_scratch(4096, 128, 0) is a and _host.triton_scratch(100, 64, 0) is a
    b = _host.triton_scratch(4096, 128, 0x55)  # another stream: its own
    assert b is not a and _host.triton_scratch(4096, 128, 0x55) is b
    device[0] = 1  # the default stream (raw 0) of another device: its own
    c = _host.triton_scratch(4096, 128, 0)
    assert c is not a
    device[0] = 0
    bigger = _host.triton_scratch(8192, 128, 0)  # grown, kept from then on
    assert bigger is not a and bigger.size == 8192
    assert _host.triton_scratch(4096, 128, 0) is bigger
    assert _host.triton_scratch(64, 1024, 0) is not bigger  # alignment the cache can't promise
    monkeypatch.setenv(_host.HOST_CACHE_ENV, "0")
    assert _host.triton_scratch(64, 128, 0) is not _host.triton_scratch(64, 128, 0)
