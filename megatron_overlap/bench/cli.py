"""argparse value types and argument checks shared by the launchers in `launch/` (each error
names the value and what was expected, and becomes a one-line usage error, exit status 2)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Iterator, Optional, Tuple


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _integer(text, 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 0") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected finite number >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value


def float_in(low: float, high: float):
    """An argparse type: a number in [low, high] (finite)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number in "
                                             f"[{low:g}, {high:g}]")
        return value

    return parse


def add_timing_args(parser: argparse.ArgumentParser, *, warmup: int, iters: int, per: str,
                    iters_help: str = "") -> None:
    """--warmup, --iters and --seed, as every GPU launcher takes them (`per` says what one
    sample is: "per k", "per provider", ...)."""
    parser.add_argument("--warmup", type=non_negative_int, default=warmup,
                        help=f"untimed runs {per} before the timed ones")
    parser.add_argument("--iters", type=positive_int, default=iters,
                        help=f"timed runs {per} (median){iters_help}")
    parser.add_argument("--seed", type=int, default=0, help="routing and data seed")


def init_cuda_group(script: str, hint: str = ""):
    """Bind this torchrun rank to its GPU (LOCAL_RANK) and start the NCCL process group.

    Returns:
        the rank's `torch.device`, or None after printing that `script` needs CUDA GPUs
        (the caller exits with status 2).
    """
    import os
    import sys

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print(f"{script}: needs CUDA GPUs (none visible){hint}", file=sys.stderr)
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    return device


def parse_layout(text: str) -> tuple[int, int]:
    """(TP, EP) of a layout name: "ep2" -> (1, 2), "tp2" -> (2, 1), "tp2ep2" -> (2, 2),
    "tp1ep1" -> (1, 1).

    Raises:
        argparse.ArgumentTypeError: anything else (sizes must be >= 1).
    """
    import re

    match = re.fullmatch(r"(?:tp(\d+))?(?:ep(\d+))?", text)
    if not text or match is None or not any(match.groups()):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected epN, tpN or tpXepY (e.g. ep2, tp2, tp1ep1)")
    tp, ep = (int(g) if g else 1 for g in match.groups())
    if tp < 1 or ep < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be >= 1")
    return tp, ep


def layout_sizes(layout: str, world: int) -> tuple[int, int]:
    """(TP, EP) of an operator-benchmark layout on `world` ranks: "ep" (EP = world), "tp"
    (TP = world) or an explicit `parse_layout` name whose TP x EP is the world size
    (e.g. "tp2ep2" on 4 ranks).

    Raises:
        ValueError: an unknown name, or TP x EP != world.
    """
    if layout == "ep":
        return 1, world
    if layout == "tp":
        return world, 1
    try:
        tp, ep = parse_layout(layout)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"layout {err}; or 'ep' / 'tp' (the whole world)") from None
    if tp * ep != world:
        raise ValueError(f"layout {layout!r}: TP x EP = {tp * ep}, but there are {world} ranks")
    return tp, ep


def layout_label(tp: int, ep: int) -> str:
    """The name rows carry: "ep2", "tp2", "tp2ep2" ("ep1" for one rank)."""
    if tp == 1:
        return f"ep{ep}"
    if ep == 1:
        return f"tp{tp}"
    return f"tp{tp}ep{ep}"


@contextlib.contextmanager
def alt_environment(alt: Optional[Tuple[str, str]]):
    """Inside: os.environ[var] = value (alt = (var, value); None: nothing); restored on
    exit, unset again where it was unset. The launchers' A/Bs of a variable the fused path
    reads per call (`bench_layer.py --alt-env`, `bench_host.py --gpu`)."""
    if alt is None:
        yield
        return
    var, value = alt
    before = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = before


def make_folder(out: str, flag: str = "--out") -> None:
    """Create the folder of the file path `out` (and its parents) if missing.

    Raises:
        ValueError: it cannot be made: the message names the part of its path that is not a
            directory (the OS says only "File exists" or "Not a directory"), or the OS's
            reason.
    """
    folder = os.path.dirname(out)
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        # the deepest part of the folder's path that exists: a non-directory there is the
        # reason
        existing = folder
        while existing and not os.path.lexists(existing):
            parent = os.path.dirname(existing)
            existing = "" if parent == existing else parent
        if existing and not os.path.isdir(existing):
            raise ValueError(f"{flag} {out!r}: cannot create its folder {folder!r}: "
                             f"{existing!r} is not a directory") from None
        raise ValueError(f"{flag} {out!r}: cannot create its folder {folder!r} "
                         f"({err.strerror})") from None


def check_launch_inputs(out: str, flag: str = "--out") -> None:
    """What every launcher checks before any work: each `MEGATRON_OVERLAP_*` variable
    (`megatron_overlap.config.check_environment`), that the results file `out` does not
    name a directory, that its folder exists or can be created (created here), and that
    the file can be opened for appending (otherwise found only when the rows are written;
    a file made for the check is removed).

    Raises:
        ValueError: a bad variable, `out` is an existing directory, its folder cannot be
            created (a path component is a file, no permission; the OS's reason named), or
            the file cannot be written.
        ImportError: `MEGATRON_OVERLAP_SOLVER=cpp` without the built C++ solver.
    """
    from megatron_overlap.config import check_environment

    check_environment()
    if not out:
        return
    if os.path.isdir(out) or out.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {out!r} is a directory: give a file path")
    folder = os.path.dirname(out)
    if folder:
        make_folder(out, flag)
        if os.path.isdir(out):  # e.g. "new/../results": a directory once "new" exists
            raise ValueError(f"{flag} {out!r} is a directory: give a file path")
    # Writable? (a folder can exist and still refuse files: no permission, a read-only or
    # special file system such as /proc.) An existing file is opened for appending, as the
    # rows will be; a new one is made exclusively (so this check knows it made it) and
    # removed again while still empty. Non-blocking, so that a FIFO without a reader fails
    # instead of waiting. A dangling symbolic link is left alone (its target may be made
    # when the rows are written).
    if os.path.islink(out) and not os.path.exists(out):
        return
    created = not os.path.lexists(out)
    mode = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(out, mode | (os.O_CREAT | os.O_EXCL if created else 0))
    except FileExistsError:  # made meanwhile (another rank's check): append to it then
        created = False
        try:
            fd = os.open(out, mode)
        except OSError as err:
            raise ValueError(f"{flag} {out!r} cannot be written ({err.strerror})") from None
    except OSError as err:
        raise ValueError(f"{flag} {out!r} cannot be written ({err.strerror})") from None
    try:
        empty = os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    if created and empty:
        try:
            os.remove(out)
        except OSError:
            pass


def available_host_bytes() -> int | None:
    """Host memory available for new allocations (Linux `/proc/meminfo` MemAvailable), in
    bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostMemoryError(MemoryError):
    """`check_host_memory`'s refusal (the launchers report it as a usage error)."""


def check_host_memory(param_bytes: int, copies: int, what: str,
                      available: int | None = None) -> None:
    """Before a CPU run builds `copies` copies of a model of `param_bytes` of parameters
    (one per variant, summed over the host's ranks): refuse when they would not fit in the
    host memory available now, instead of letting the OS's out-of-memory killer end the
    run without a word. One copy more is counted for the transient of building them
    (Megatron's initialisation held about twice the parameters of the model it built, on
    the dev CPU: mixtral-8x7b with 2 layers, 12.7 GB of fp32 parameters, reached 24 GB).

    Args:
        param_bytes: bytes of one copy's parameters (e.g. `models.approx_param_count` x the
            dtype's size).
        copies: copies the run builds.
        what: names the model in the message (e.g. "mixtral-8x7b, 2 layers").
        available: bytes available (default `available_host_bytes()`; None: no check).

    Raises:
        HostMemoryError: they need more than 90 % of the available memory (names both).
    """
    if available is None:
        available = available_host_bytes()
    if available is None or copies <= 0:
        return
    need = param_bytes * (copies + 1)
    if need > 0.9 * available:
        gib = 2**30
        raise HostMemoryError(
            f"{what}: {copies} copies of its ~{param_bytes / gib:.1f} GiB of parameters (one "
            f"per variant) and their build need ~{need / gib:.1f} GiB of host memory, "
            f"{available / gib:.1f} GiB are available; on the CPU use a smaller model "
            "(e.g. --model tiny), fewer layers, or a GPU")


def json_rows(path: str) -> Iterator[Tuple[int, object]]:
    """(line number, parsed value) of every non-blank line of a .jsonl file.

    Raises:
        ValueError: a line is not JSON ("PATH:LINE: not JSON (...)").
        OSError: the file cannot be read.
    """
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
