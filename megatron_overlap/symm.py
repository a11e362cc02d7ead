"""Symmetric-memory workspace of the fused GEMM2 + GatherRS kernels.

One `GatherRSWorkspace` per (tp_ep process group, hidden size, dtype). It holds:

* the receive buffer, [capacity_rows, H] in the op dtype, in symmetric memory (every rank
  can store into every other rank's copy), one region reused by every call. In the direct
  mode it holds only the rows other ranks send (a rank's own rows go to a per-call local
  buffer, `ops.triton_gemm2_gatherrs`); in the pre-reduced mode one slot per source rank,
  this rank's own included.
* the signal counters, int64 [2R] in symmetric memory, never reset (so no reset can race a
  late increment):
  - arrivals, [0, R): counter s on rank g counts the GEMM2 tiles sender s stored into g's
    buffer (in the pre-reduced mode: its send CTAs for g), summed over all calls. Each
    rank keeps the running total it expects from every sender (`add_expected_arrivals`),
    which all ranks compute alike from the exchanged routing counts;
  - finalize counts, [R, 2R): counter R + g on rank s counts the calls whose finalize rank
    g has finished (its last finalize CTA adds 1 on every other rank). Before sender s
    stores call i's rows into g's buffer it waits until that count reaches i - 1, i.e. g
    has read call i - 1's rows: no rank overwrites rows a peer is still reading. The wait
    almost never waits: between two calls lies the rest of the layer (or model).
* this rank's count of finished finalize CTAs (int64, local), which tells a finalize CTA
  that it is its call's last.
* the order of the calls: peers wait for this rank's finalizes in call order, a finalize
  finds out that it is its call's last from the running count of finalize CTAs, and a
  pre-reduced call's own slot is ordered after the previous call's finalize by the stream
  alone, so every call on a workspace is sent in the order it was prepared, on one CUDA
  stream (`start_send` checks both). A call prepared but never run leaves its epoch
  taken on every rank: the workspace is then unusable (`poison`) and says so at once.
* the local (non-symmetric) error record the kernels write on a timeout, and its pinned
  host copy, read asynchronously (`record_error_check`, `check_errors`).

The capacity only grows, and only by a collective decision every rank makes alike: the rows
each rank will receive are known on every rank from the exchanged routing counts
(`GatherRSMetadata.routed_counts`), so all ranks grow at the same call.

PyTorch symmetric memory (`torch.distributed._symmetric_memory`) does the allocation and the
exchange of peer addresses (its rendezvous). Without a process group (world 1, or the
Triton interpreter on CPU) plain local tensors stand in for it.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_overlap._host import current_stream


def _symmetric_tensor(shape, dtype, device, group):
    """A zeroed tensor in symmetric memory and its peers' addresses as int64 [R] on device."""
    import torch.distributed._symmetric_memory as symm_mem

    tensor = symm_mem.empty(shape, dtype=dtype, device=device)
    tensor.zero_()
    # Zeroed before the (collective) rendezvous returns anywhere: a peer may store into this
    # tensor as soon as its own rendezvous returns, and an asynchronous zero_ still queued
    # here would wipe those stores.
    torch.cuda.current_stream(device).synchronize()
    name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
    handle = symm_mem.rendezvous(tensor, name)
    ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    return tensor, handle, ptrs


class GatherRSWorkspace:
    """Receive buffers, arrival counters and the error record of one process group.

    Args:
        group: the tp_ep process group, or None for a single rank without a group.
        hidden: H, columns of every row.
        dtype: dtype of the rows that travel (the op's dtype).
        device: the CUDA device of this rank (or CPU for the interpreter).

    Raises:
        TypeError: hidden not an int, or dtype not a torch.dtype.
        ValueError: hidden < 1.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], *, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if not isinstance(hidden, numbers.Integral) or isinstance(hidden, bool):
            raise TypeError(f"hidden={hidden!r} must be an int")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype={dtype!r} must be a torch.dtype (e.g. torch.bfloat16)")
        hidden = int(hidden)
        if hidden < 1:
            raise ValueError(f"hidden={hidden} must be >= 1")
        self.group = group
        self.hidden = hidden
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_ranks = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.epoch = 0
        self.capacity_rows = 0
        self.compiled: set = set()  # kernel specialisations already warmed up
        # Outside inference mode: these are updated in place by every call (zero_, copy_),
        # also by calls made outside inference mode after one made inside it.
        with torch.inference_mode(False):
            self.error = torch.zeros(4, dtype=torch.int64, device=self.device)
            self.finalize_done = torch.zeros(1, dtype=torch.int64, device=self.device)
            pinned = self.device.type == "cuda"
            self._error_host = torch.zeros(4, dtype=torch.int64, pin_memory=pinned)
        self.finalize_ctas = 0  # finalize CTAs launched on this workspace so far
        self._error_event = None
        self.expected_arrivals = np.zeros(self.num_ranks, dtype=np.int64)
        self._spare_arrivals = None  # `spare_arrivals`
        self._recv = None
        self._recv_handle = None
        self.peer_recv_ptrs: Optional[torch.Tensor] = None
        if group is None:
            self.signals = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._sig_handle = None
            self.peer_signal_ptrs = torch.tensor([self.signals.data_ptr()], dtype=torch.int64,
                                                 device=self.device)
        else:
            self.signals, self._sig_handle, self.peer_signal_ptrs = _symmetric_tensor(
                (2 * self.num_ranks,), torch.int64, self.device, group
            )
        self._fixed_capacity = False
        self._destroyed = False
        self._broken: Optional[str] = None  # why the workspace is unusable (`poison`)
        self.sent_epoch = 0  # the last call sent (`start_send`)
        self.stream = None  # the CUDA stream every call runs on (the first call's)
        # per-call buffers kept for reuse by the Triton launcher (ops.triton_gemm2_gatherrs)
        self.staging_slots: list = []

    @property
    def recv(self) -> torch.Tensor:
        """[capacity_rows, H] receive buffer of this rank."""
        self._check_alive()
        return self._recv

    def ensure_capacity(self, rows: int) -> None:
        """Grow the receive buffer to hold `rows` rows (collective when it grows).

        Every rank must call this with the same `rows` (the maximum over ranks of the rows
        each receives from the others, `DirectLayout.recv_rows`, or R x the largest token
        count in the pre-reduced mode, which all ranks compute alike). The first allocation
        is exactly `rows` (fixed shapes, as in a prefill or training run at one sequence
        length, then never grow and carry no headroom: the buffer is the flag's main extra
        memory); a later growth takes 1/8 more than asked, so that slowly growing inputs
        reallocate rarely without doubling the memory.

        Raises:
            ValueError: rows < 0, or more rows than a fixed-capacity workspace
                (`local_workspaces`) holds.
            RuntimeError: the workspace was destroyed.
        """
        self._check_alive()
        if rows < 0:
            raise ValueError(f"rows={rows} must be >= 0")
        if rows <= self.capacity_rows and self._recv is not None:
            return
        if self._fixed_capacity:
            raise ValueError(f"this workspace holds {self.capacity_rows} rows, the call needs "
                             f"{rows}")
        # Exact the first time; 1/8 headroom once the inputs have shown they grow (a
        # growth is a collective and a device sync).
        first = self._recv is None or self.capacity_rows <= 1  # (1: a first call of 0 rows)
        new_rows = max(rows if first else rows + rows // 8, 1)
        shape = (new_rows, self.hidden)
        if self.group is None:
            self._recv = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.peer_recv_ptrs = torch.tensor([self._recv.data_ptr()], dtype=torch.int64,
                                               device=self.device)
        else:
            torch.cuda.current_stream(self.device).synchronize()  # no kernel still uses the old
            dist.barrier(group=self.group)
            self._recv, self._recv_handle, self.peer_recv_ptrs = _symmetric_tensor(
                shape, self.dtype, self.device, self.group
            )
        self.capacity_rows = new_rows

    def next_epoch(self) -> int:
        """Advance and return the call counter (1 for the first call)."""
        self._check_alive()
        self.epoch += 1
        return self.epoch

    def start_send(self, epoch: int, stream) -> None:
        """Check that call `epoch` is sent next and on the workspace's stream.

        One receive buffer serves every call: a peer's producers wait for this rank's
        finalizes in call order, the finalize CTAs are counted in launch order, and a
        pre-reduced call's own slot is ordered after the previous call's finalize only by
        the stream. So every call on a workspace must be sent in the order the calls were
        prepared, on one CUDA stream (the first call's).

        Raises:
            RuntimeError: the workspace is unusable (`poison`), a call is sent out of order,
                or on another stream.
        """
        self._check_alive()
        if epoch != self.sent_epoch + 1:
            self.poison(f"call {epoch} was sent after call {self.sent_epoch}: prepared calls "
                        "must be run in the order they were prepared")
            self._check_alive()
        if self.stream is None:
            self.stream = stream
        elif stream != self.stream:
            raise RuntimeError(
                f"gemm2_gatherrs (Triton) call {epoch} sent on {stream}, the workspace's calls "
                f"run on {self.stream}: one receive buffer serves every call, ordered by that "
                "stream (use one stream, or another process group)")
        self.sent_epoch = epoch

    def poison(self, reason: str) -> None:
        """Mark the workspace unusable: a call's epoch was taken (its arrivals and finalize
        count are expected on every rank) and the call will not run, so every later call
        would wait out the timeout. Later calls raise at once, naming `reason`."""
        self._broken = reason

    def add_expected_arrivals(self, arrivals: np.ndarray) -> np.ndarray:
        """Add one call's arrivals per sender ([R] int64) to the running totals; returns the
        new totals (the call's targets): copy them to keep them, since `take_arrivals` may
        reuse that array two calls later (`spare_arrivals`).

        Raises:
            ValueError: `arrivals` is not of shape [R].
        """
        self._check_alive()
        arrivals = np.asarray(arrivals, dtype=np.int64)
        if arrivals.shape != self.expected_arrivals.shape:
            raise ValueError(f"arrivals of shape {arrivals.shape}, expected "
                             f"{self.expected_arrivals.shape} (one per rank of the group)")
        self.expected_arrivals = self.expected_arrivals + arrivals
        return self.expected_arrivals

    def spare_arrivals(self) -> np.ndarray:
        """An int64 [R] array for a call to write the new running totals into (its targets:
        the totals plus its arrivals, `ops._layout.direct_tables`), then hand to
        `take_arrivals`. It is the array the totals were held in before the last
        `take_arrivals`, reused: `expected_arrivals` is replaced by every call, and its old
        array may be overwritten two calls later (copy it to keep it)."""
        spare = self._spare_arrivals
        if (spare is None or spare.shape != self.expected_arrivals.shape
                or spare is self.expected_arrivals):
            spare = self._spare_arrivals = np.empty_like(self.expected_arrivals)
        return spare

    def take_arrivals(self, totals: np.ndarray) -> None:
        """Make `totals` (the array `spare_arrivals` returned, filled with this call's new
        running totals) the running totals: what `add_expected_arrivals` does, without an
        array operation.

        Raises:
            ValueError: `totals` is not the array `spare_arrivals` returned.
            RuntimeError: the workspace was destroyed.
        """
        self._check_alive()
        if totals is not self._spare_arrivals:
            raise ValueError("take_arrivals takes the array spare_arrivals returned")
        self._spare_arrivals, self.expected_arrivals = self.expected_arrivals, totals

    def add_finalize_ctas(self, num_ctas: int) -> int:
        """Count one finalize launch of `num_ctas` CTAs; returns the running total (the value
        `finalize_done` reaches when that launch's last CTA is done).

        The total stays below 2^31 (so the kernel argument keeps one integer type and no
        launch recompiles): before it would pass, the device counter is zeroed on the
        current stream (after every earlier finalize, which ran on it) and the total
        restarts.
        """
        self._check_alive()
        if self.finalize_ctas + int(num_ctas) >= 2**31 - 1:
            self.finalize_done.zero_()
            self.finalize_ctas = 0
        self.finalize_ctas += int(num_ctas)
        return self.finalize_ctas

    def record_error_check(self, stream=None) -> None:
        """Queue an asynchronous copy of the error record (after the kernels just launched on
        the current stream, which the caller may pass as `stream`); `check_errors` reads
        it."""
        self._check_alive()
        if self.device.type != "cuda":
            return
        self._error_host.copy_(self.error, non_blocking=True)
        if self._error_event is None:
            self._error_event = torch.cuda.Event()
        self._error_event.record(current_stream(self.device) if stream is None
                                 else stream)

    def check_errors(self, block: bool = True) -> None:
        """Raise if a kernel recorded a timeout.

        Args:
            block: wait for the last queued copy (`record_error_check`); otherwise look only
                if it has completed (no host sync).

        Raises:
            RuntimeError: names this rank, the rank waited for, the count seen and the count
                expected: a finalize that waited for a sender's arrivals, or a GEMM2
                producer or a pre-reduced send that waited for a destination's finalize
                count (its receive buffer still in use). The ranks' counters are out of
                step afterwards: later calls on the workspace are likely to time out too
                (they are not blocked); destroy and rebuild the workspaces on every rank.
        """
        if self._destroyed:
            return
        if self.device.type == "cuda":
            if self._error_event is None:
                return
            if block:
                self._error_event.synchronize()
            elif not self._error_event.query():
                return
            record = self._error_host
        else:
            record = self.error
        code, sender, seen, expected = (int(x) for x in record.tolist())
        if code == 0:
            return
        self.error.zero_()
        self._error_host.zero_()
        from megatron_overlap.kernels.gemm2_gatherrs import ERR_PRODUCER_WAIT, ERR_SEND_WAIT

        if code in (ERR_PRODUCER_WAIT, ERR_SEND_WAIT):
            who = ("the GEMM2 producer" if code == ERR_PRODUCER_WAIT
                   else "the pre-reduced send")
            what = (f"{who} timed out waiting for rank {sender} to free its "
                    f"receive buffer: its finalize count {seen}, expected >= {expected} (its "
                    "finalize of the previous call has not run)")
        else:
            what = (f"finalize timed out waiting for sender rank {sender}: arrival counter "
                    f"{seen}, expected >= {expected}")
        raise RuntimeError(
            f"gemm2_gatherrs (Triton) on tp_ep rank {self.rank}: {what} (error code {code}; "
            f"epoch {self.epoch}). The ranks' counters are out of step now: later calls on "
            "this workspace are likely to time out too (it is not blocked, so that every "
            "rank's report surfaces); destroy the workspaces on every rank "
            "(symm.destroy_workspaces) and build new ones."
        )

    def destroy(self) -> None:
        """Release the buffers (a collective). The workspace cannot be used afterwards.

        Raises:
            RuntimeError: a kernel recorded a timeout not reported yet (after releasing).
        """
        if self._destroyed:
            return
        pending = None
        if self.group is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            dist.barrier(group=self.group)
        try:
            self.check_errors(block=True)
        except RuntimeError as err:
            pending = err
        self._recv = self._recv_handle = self._sig_handle = None
        self.signals = self.peer_signal_ptrs = self.peer_recv_ptrs = None
        self.staging_slots = []
        self._destroyed = True
        if pending is not None:
            raise pending

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("GatherRSWorkspace was destroyed; create a new one")
        if self._broken is not None:
            raise RuntimeError(f"GatherRSWorkspace of tp_ep rank {self.rank} is unusable: "
                               f"{self._broken}. The ranks' counters are out of step; "
                               "destroy it and build a new one on every rank.")


def local_workspaces(num_ranks: int, *, hidden: int, dtype: torch.dtype, device,
                     capacity_rows: int) -> list:
    """`num_ranks` workspaces in one process whose peer tables point at each other.

    The stand-in for symmetric memory when one process plays every rank (the Triton
    interpreter on CPU, in tests): rank r's "peer" buffers are the other workspaces' local
    tensors. Capacity is fixed; a call needing more raises ValueError.
    """
    spaces = [GatherRSWorkspace(None, hidden=hidden, dtype=dtype, device=device)
              for _ in range(num_ranks)]
    for rank, ws in enumerate(spaces):
        ws.num_ranks, ws.rank = num_ranks, rank
        ws.signals = torch.zeros(2 * num_ranks, dtype=torch.int64, device=device)
        ws.expected_arrivals = np.zeros(num_ranks, dtype=np.int64)
        ws._recv = torch.zeros(capacity_rows, hidden, dtype=dtype, device=device)
        ws.capacity_rows, ws._fixed_capacity = capacity_rows, True
    recv_ptrs = torch.tensor([ws._recv.data_ptr() for ws in spaces], dtype=torch.int64,
                             device=device)
    sig_ptrs = torch.tensor([ws.signals.data_ptr() for ws in spaces], dtype=torch.int64,
                            device=device)
    for ws in spaces:
        ws.peer_recv_ptrs, ws.peer_signal_ptrs = recv_ptrs, sig_ptrs
    return spaces


_WORKSPACES: dict = {}


def get_workspace(group: Optional[dist.ProcessGroup], *, hidden: int, dtype: torch.dtype,
                  device: torch.device) -> GatherRSWorkspace:
    """The process-wide workspace of (group, hidden, dtype, device), created on first use."""
    key = (None if group is None else group.group_name, hidden, dtype, str(device))
    ws = _WORKSPACES.get(key)
    if ws is None or ws._destroyed:
        ws = GatherRSWorkspace(group, hidden=hidden, dtype=dtype, device=device)
        _WORKSPACES[key] = ws
    return ws


def destroy_workspaces() -> None:
    """Destroy every workspace `get_workspace` created (call on every rank).

    Raises:
        RuntimeError: the first unreported kernel timeout (every workspace is destroyed)."""
    first = None
    for ws in _WORKSPACES.values():
        try:
            ws.destroy()
        except RuntimeError as err:
            first = first or err
    _WORKSPACES.clear()
    if first is not None:
        raise first
