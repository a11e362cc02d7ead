"""Run a function on several CPU processes joined by a gloo process group, for pytest.

`run_distributed(fn, world_size, *args, **kwargs)` starts `world_size` processes, joins them
in a gloo process group, calls `fn(rank, world_size, *args, **kwargs)` on each and returns
the per-rank results in rank order. A rank that raises, dies or outlives `timeout_s` fails the
call with an `AssertionError` naming the rank and carrying its traceback; it never hangs.

Start cost is what dominates these tests (importing torch + megatron.core takes ~6 s of CPU
per process; four ranks on a 2-core CI machine take ~12 s), so:

* processes come from a *forkserver* that has already imported torch and Megatron's GPT/MoE
  modules (`FORKSERVER_PRELOAD`): after the first launch of a pytest session (which pays the
  ~6 s once) a rank starts in a fraction of a second, whichever test module launches first;
* `fn` should run many cases per launch. `for_each_case` loops over cases and labels a
  failure with the case that raised, e.g.::

      def _worker(rank: int, world_size: int, cases: list[Case]) -> list[Result]:
          return for_each_case(cases, lambda case: _run_case(rank, case))

      results = run_distributed(_worker, 4, cases)  # results[rank][case_index]

Each rank gets `torch.set_num_threads(max(1, usable_cores // world_size))` so that ranks do
not oversubscribe the cores. A rank that hangs is reported with its Python stacks
(faulthandler), so a timeout says where each stuck rank was waiting.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["FORKSERVER_PRELOAD", "DistributedRunError", "for_each_case", "run_distributed"]

_C = TypeVar("_C")
_R = TypeVar("_R")

#: How long the other ranks get to report their own error after the first rank failed
#: (their tracebacks are often the informative ones), before they are killed.
_GRACE_AFTER_FAILURE_S = 3.0
#: How long ranks get to tear down and exit on their own after all of them reported success.
_EXIT_WAIT_S = 10.0
#: How long a rank gets to exit after SIGTERM before SIGKILL.
_TERMINATE_WAIT_S = 5.0
#: How long a stuck rank gets to write its stacks after SIGUSR1.
_STACK_DUMP_WAIT_S = 2.0

_OK, _ERROR = "ok", "error"

#: Imported once by the forkserver, before it forks any rank. A module that is not installed
#: is skipped (multiprocessing ignores ImportError while preloading).
FORKSERVER_PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "megatron.core.models.gpt",
    "megatron.core.transformer.moe.moe_layer",
)

_preload_requested = False


class DistributedRunError(AssertionError):
    """A rank raised, died, or did not finish within the timeout.

    An `AssertionError` so that pytest reports it as a test failure. `failures` maps each
    failing rank to its message (a traceback where the rank could send one), in the order
    the failures arrived.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


def for_each_case(cases: Iterable[_C], run_case: Callable[[_C], _R]) -> list[_R]:
    """Run `run_case` on every case in order; a failure names the case that raised.

    Raises:
        RuntimeError: chained to the case's exception, with the case's index and repr.
    """
    results = []
    for index, case in enumerate(cases):
        try:
            results.append(run_case(case))
        except Exception as exc:
            raise RuntimeError(f"case {index} failed: {case!r}") from exc
    return results


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo-connected processes.

    Each rank runs in its own process with `MASTER_ADDR=127.0.0.1`, `MASTER_PORT`, `RANK`,
    `WORLD_SIZE` and `LOCAL_RANK` set and the default process group initialised (backend
    gloo, store hosted by this process, so there is no free-port race). The process group is
    destroyed after `fn` returns.

    Args:
        fn: a module-level function (it is pickled by reference and imported in the workers).
        world_size: number of ranks, >= 1.
        *args, **kwargs: passed to `fn`; must be picklable.
        timeout_s: wall-clock limit for the whole run, start-up included. Also the
            collective timeout inside the ranks.
        backend: "gloo" (CPU), or "nccl" (GPU tests: rank r uses cuda:r, set before the
            process group is created).

    Returns:
        The return values of `fn`, indexed by rank. They must be picklable (tensors are).

    Raises:
        ValueError: `world_size` < 1 or `timeout_s` <= 0.
        TypeError: `fn` is not a module-level function.
        DistributedRunError: (an `AssertionError`) a rank raised, died, or the run took longer
            than `timeout_s`; the message holds every failing rank's traceback. All ranks
            are killed before it is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    _check_importable(fn)

    import torch.distributed as dist  # deferred: importing torch costs seconds

    # CUDA cannot be used in a process forked from one that initialised it (the forkserver
    # may have, through Megatron's imports): GPU ranks are spawned afresh.
    if backend == "nccl":
        ctx = multiprocessing.get_context("spawn")
    else:
        ctx = _forkserver_context(fn.__module__)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    payload = pickle.dumps((fn, args, kwargs))
    receivers: dict[multiprocessing.connection.Connection, int] = {}
    procs: list[multiprocessing.process.BaseProcess] = []
    all_reported_ok = False
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as stack_dir:
        try:
            for rank in range(world_size):
                receiver, sender = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, store.port, timeout_s, payload, sender, stack_dir,
                          backend),
                    name=f"rank{rank}",
                    daemon=True,
                )
                proc.start()
                sender.close()
                receivers[receiver] = rank
                procs.append(proc)
            results, failures = _collect(receivers, procs, deadline, timeout_s, Path(stack_dir))
            all_reported_ok = not failures
        finally:
            # Successful ranks finish a barrier and tear the group down; the rest is killed.
            _stop(procs, exit_wait_s=_EXIT_WAIT_S if all_reported_ok else 0.0)
            for receiver in receivers:
                receiver.close()
            del store
    if failures:
        # In the order the failures arrived: the first is usually the cause, the others
        # collateral (a peer's closed connection, a kill after the grace period).
        ranks = ", ".join(str(r) for r in failures)
        details = "\n".join(f"----- rank {r} -----\n{text}" for r, text in failures.items())
        raise DistributedRunError(
            f"run_distributed({fn.__module__}.{fn.__qualname__}, world_size={world_size}) "
            f"failed on rank(s) {ranks} (in order of arrival):\n{details}",
            failures,
        )
    return [results[rank] for rank in range(world_size)]


def _check_importable(fn: Callable[..., Any]) -> None:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module is None or "<" in qualname or module == "__main__":
        raise TypeError(
            f"fn must be a module-level function importable by the workers, got {fn!r} "
            f"(module={module!r}, qualname={qualname!r})"
        )


def _forkserver_context(preload_module: str) -> multiprocessing.context.BaseContext:
    """The forkserver context; the first call sets what the server preloads.

    The server starts once per interpreter (on the first launch) and preloads
    `FORKSERVER_PRELOAD` and `preload_module`. The latter only if the server can import it:
    Python 3.11's forkserver ignores the parent's sys.path (forkserver.main drops its
    `sys_path` argument), so a test module that pytest imported by inserting its folder
    into sys.path is imported by each child instead, cheaply since Megatron is preloaded.
    """
    global _preload_requested
    ctx = multiprocessing.get_context("forkserver")
    if not _preload_requested:  # only the first request can take effect
        ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, preload_module])
        _preload_requested = True
    return ctx


def _collect(
    receivers: dict[multiprocessing.connection.Connection, int],
    procs: Sequence[multiprocessing.process.BaseProcess],
    deadline: float,
    timeout_s: float,
    stack_dir: Path,
) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every rank's report until `deadline`; stop early after a failure + grace.

    A rank that never reports gets its Python stacks (faulthandler, all threads) in its
    failure message: the traceback of where it was stuck.
    """
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = dict(receivers)
    while pending:
        now = time.monotonic()
        if failures:
            deadline = min(deadline, now + _GRACE_AFTER_FAILURE_S)
        if now >= deadline:
            break
        ready = multiprocessing.connection.wait(list(pending), timeout=deadline - now)
        for conn in ready:
            rank = pending.pop(conn)  # type: ignore[arg-type]
            try:
                data = conn.recv_bytes()  # type: ignore[union-attr]
            except (EOFError, OSError):
                procs[rank].join(timeout=1.0)
                failures[rank] = (
                    f"process exited without reporting (exit code {procs[rank].exitcode})"
                    + _stacks_text(stack_dir, rank)
                )
                continue
            try:
                status, body = pickle.loads(data)
            except Exception:  # noqa: BLE001 - reported as this rank's failure
                status = _ERROR
                body = f"result could not be unpickled here:\n{traceback.format_exc()}"
            if status == _OK:
                results[rank] = body
            else:
                failures[rank] = body
    stuck = sorted(pending.values())
    for rank in stuck:
        if procs[rank].is_alive() and procs[rank].pid is not None:
            os.kill(procs[rank].pid, signal.SIGUSR1)  # faulthandler: dump all thread stacks
    _wait_for_stacks(stack_dir, stuck)
    reason = (
        "still running after another rank failed; killed"
        if failures
        else f"did not finish within timeout_s={timeout_s}; killed"
    )
    for rank in stuck:
        failures[rank] = reason + _stacks_text(stack_dir, rank)
    return results, failures


def _stack_file(stack_dir: Path, rank: int) -> Path:
    return stack_dir / f"rank{rank}.stacks"


def _wait_for_stacks(stack_dir: Path, ranks: Sequence[int]) -> None:
    end = time.monotonic() + _STACK_DUMP_WAIT_S
    while time.monotonic() < end:
        files = [_stack_file(stack_dir, rank) for rank in ranks]
        if all(f.exists() and f.stat().st_size > 0 for f in files):
            time.sleep(0.1)  # let the last thread's frames be written
            return
        time.sleep(0.05)


def _stacks_text(stack_dir: Path, rank: int) -> str:
    path = _stack_file(stack_dir, rank)
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return f"\nPython stacks (faulthandler):\n{text}" if text else ""


def _stop(procs: Sequence[multiprocessing.process.BaseProcess], exit_wait_s: float) -> None:
    """Give the processes `exit_wait_s` to exit, then terminate and kill; reap all of them."""
    end = time.monotonic() + exit_wait_s
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + _TERMINATE_WAIT_S
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=_TERMINATE_WAIT_S)


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    payload: bytes,
    sender: multiprocessing.connection.Connection,
    stack_dir: str,
    backend: str,
) -> None:
    """Body of one rank: join the process group, run `fn`, send ("ok"|"error", body).

    faulthandler writes this rank's stacks to its file in `stack_dir` on SIGUSR1 (sent by
    the parent to a rank that is stuck) and on a fatal signal (segfault, abort).
    """
    stack_file = _stack_file(Path(stack_dir), rank).open("w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    ok = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        fn, args, kwargs = pickle.loads(payload)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        message = pickle.dumps((_OK, result))
        ok = True
    except BaseException:  # noqa: BLE001 - report everything, pytest.skip/exit included
        message = pickle.dumps((_ERROR, traceback.format_exc()))
    try:
        sender.send_bytes(message)
    finally:
        sender.close()
    if ok:
        import torch.distributed as dist

        # Only after a success: the other ranks may still need the group (or be stuck).
        dist.barrier()
        dist.destroy_process_group()
