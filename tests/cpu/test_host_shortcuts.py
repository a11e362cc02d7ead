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
    """Stand-ins for torch's current-stream calls: `ident[device]` is the current stream's
    (stream id, device index, device type); `current_stream` returns a new object per call,
    as torch does."""

    def __init__(self):
        self.ident = {0: (0, 0, 1), 1: (0, 1, 1)}
        self.made = 0

    def stream_id(self, index):
        return self.ident[index]

    def current_stream(self, index=None):
        self.made += 1
        return ("stream", index, self.ident[index], self.made)


def test_current_stream_is_cached_by_stream_identity(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(_host, "_STREAM_ID", fake.stream_id)
    monkeypatch.setattr(_host, "_STREAMS", {})
    monkeypatch.setattr(_host.torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(_host.torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv(_host.HOST_CACHE_ENV, raising=False)
    device0 = _host.torch.device("cuda", 0)
    first = _host.current_stream(device0)
    assert _host.current_stream(device0) is first and _host.current_stream(0) is first
    fake.ident[0] = (35, 0, 1)  # a pool stream made current on device 0
    second = _host.current_stream(device0)
    assert second is not first and second[2] == (35, 0, 1)
    assert _host.current_stream(device0) is second
    # an ExternalStream of the same CUDA stream: same handle, another torch identity
    fake.ident[0] = (0x7F00, 0, 1)
    external = _host.current_stream(device0)
    assert external is not second and external[2] == (0x7F00, 0, 1)
    fake.ident[0] = (0, 0, 1)  # back to the default stream: a fresh object for it
    third = _host.current_stream(device0)
    assert third[2] == (0, 0, 1) and _host.current_stream(device0) is third
    # None and a device without an index: the current device (1 here), cached apart
    other = _host.current_stream(None)
    assert other[1] == 1 and _host.current_stream(_host.torch.device("cuda")) is other
    assert _host.current_stream(device0) is third
    # turned off: the plain call every time
    monkeypatch.setenv(_host.HOST_CACHE_ENV, "0")
    made = fake.made
    assert _host.current_stream(device0) is not _host.current_stream(device0)
    assert fake.made == made + 2


def test_getenv_falls_back_where_os_environ_was_replaced(monkeypatch):
    monkeypatch.setattr(os, "environ", {NAME: "replaced"})
    assert _host.getenv(NAME) == "replaced" and _host.getenv("MEGATRON_OVERLAP_NOPE") is None
    from megatron_overlap import config

    assert config.tile_list_source() == "device"  # reads through getenv


def test_triton_scratch_is_kept_per_device_and_stream(monkeypatch):
    """Inside `own_launch()`: one buffer per (device, raw stream), grown when a launch asks
    for more; a fresh one per launch outside it, while capturing a CUDA graph, with the
    cache off, or for an alignment beyond the caching allocator's."""
    made = []

    class Buf:
        def __init__(self, size):
            self.size = size
            made.append(self)

        def numel(self):
            return self.size

    device, capturing = [0], [False]
    monkeypatch.setattr(_host, "_SCRATCH", {})
    monkeypatch.setattr(_host.torch, "empty", lambda size, dtype=None, device=None: Buf(size))
    monkeypatch.setattr(_host.torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(_host.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.delenv(_host.HOST_CACHE_ENV, raising=False)
    scratch = _host.triton_scratch
    assert scratch(64, 128, 0) is not scratch(64, 128, 0)  # not our launch: new each time
    with _host.own_launch():
        a = scratch(4096, 128, 0)
        with _host.own_launch():  # reentrant
            assert scratch(4096, 128, 0) is a
        assert scratch(4096, 128, 0) is a and scratch(100, 64, 0) is a
        b = scratch(4096, 128, 0x55)  # another stream: its own
        assert b is not a and scratch(4096, 128, 0x55) is b
        device[0] = 1  # the default stream (raw 0) of another device: its own
        c = scratch(4096, 128, 0)
        assert c is not a
        device[0] = 0
        bigger = scratch(8192, 128, 0)  # grown, kept from then on
        assert bigger is not a and bigger.size == 8192
        assert scratch(4096, 128, 0) is bigger
        assert scratch(64, 1024, 0) is not bigger  # alignment the cache can't promise
        capturing[0] = True  # a CUDA graph's capture: its replays own their memory
        assert scratch(64, 128, 0) is not bigger
        capturing[0] = False
        monkeypatch.setenv(_host.HOST_CACHE_ENV, "0")
        assert scratch(64, 128, 0) is not scratch(64, 128, 0)
    monkeypatch.delenv(_host.HOST_CACHE_ENV)
    assert scratch(4096, 128, 0) is not bigger  # outside again
