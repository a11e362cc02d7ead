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


def int_in(low: int, high: int):
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer in "
                                             f"[{low}, {high}]")
        return value

    return parse


THRASH_MIB_MAX = 65536
"""The largest `--thrash-mib` of the host benchmarks (`bench_host.py`, `bench_sort.py`), in
MiB (64 GiB): ~60x the largest last-level caches of current server CPUs (~1 GiB per socket),
so it never limits an eviction; a thrash beyond it would only cost seconds per measurement
and the host's memory."""

THRASH_MIB_HELP = (f"(1 to {THRASH_MIB_MAX}, 64 GiB, ~60x the largest CPU caches; and at most "
                   "90 %% of the host memory available now, checked before any timing)")
"""The bound of `--thrash-mib`, as its help says it (argparse help: "%%" is "%")."""


def check_thrash_memory(mib: int, flag: str = "--thrash-mib",
                        available: int | None = None) -> None:
    """Refuse a cache thrash of `mib` MiB that the host cannot hold, before any timing:
    otherwise numpy's buffer fails only when it is made (MemoryError) or, the memory
    overcommitted, the out-of-memory killer ends the run when the thrash first writes it.

    Args:
        mib: the thrash buffer's size, MiB.
        flag: the option named in the message.
        available: bytes available (default `available_host_bytes()`; None: no check).

    Raises:
        ValueError: `mib` MiB are more than 90 % of the available memory (names both).
    """
    if available is None:
        available = available_host_bytes()
    if available is None:
        return
    if (mib << 20) > 0.9 * available:
        raise ValueError(f"{flag} {mib}: expected at most 90 % of the host memory available "
                         f"now ({available >> 20} MiB available, so at most "
                         f"{int(0.9 * available) >> 20})")


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
        argparse.ArgumentTypeError: anything else (sizes are integers >= 1 without
            leading zeros, so that each layout has one name).
    """
    import re

    match = re.fullmatch(r"(?:tp([1-9][0-9]*))?(?:ep([1-9][0-9]*))?", text)  # ASCII digits
    if not text or match is None or not any(match.groups()):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected epN, tpN or tpXepY with sizes >= 1 and no leading zeros "
            "(e.g. ep2, tp2, tp1ep1)")
    tp, ep = (int(g) if g else 1 for g in match.groups())
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
    tp, ep = check_layout_name(layout)
    if tp * ep != world:
        raise ValueError(f"layout {layout!r}: TP x EP = {tp * ep}, but there are {world} ranks")
    return tp, ep


def check_layout_name(layout: str) -> Optional[tuple[int, int]]:
    """The name check of `layout_sizes`, before the world size is known: None for "ep" /
    "tp" (their sizes follow the world), else `parse_layout`'s (TP, EP).

    Raises:
        ValueError: any other name.
    """
    if layout in ("ep", "tp"):
        return None
    try:
        return parse_layout(layout)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"layout {err}; or 'ep' / 'tp' (the whole world)") from None


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


PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
    "pstore", "bpf", "efivarfs", "fusectl", "binfmt_misc", "selinuxfs"})
"""Kernel file systems whose files are interfaces, not storage: root may open one for
appending, but a row written to it fails (`/proc/version`: "Invalid argument") or, worse,
is taken as a setting (`/sys`, cgroup files)."""


def pseudo_file_system(path: str) -> Optional[str]:
    """The type of the kernel file system (`PSEUDO_FILE_SYSTEMS`) that the existing `path`
    (symbolic links followed) lies on, e.g. "proc" for `/proc/version`, or None: another
    file system, or unknown (found by its device in `/proc/self/mountinfo`; where that
    cannot be read, a real path under /proc or /sys counts as "proc" or "sysfs")."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        real = os.path.realpath(path)
        for root, kind in (("/proc", "proc"), ("/sys", "sysfs")):
            if real == root or real.startswith(root + "/"):
                return kind
        return None
    for line in mounts:
        fields = line.split()
        # "ID PARENT MAJOR:MINOR ROOT MOUNT OPTIONS [TAGS...] - TYPE SOURCE OPTIONS"
        if len(fields) < 3 or fields[2] != want or "-" not in fields[3:]:
            continue
        sep = fields.index("-", 3)
        if sep + 1 < len(fields) and fields[sep + 1] in PSEUDO_FILE_SYSTEMS:
            return fields[sep + 1]
    return None


def _check_folder_can_be_made(out: str, flag: str) -> None:
    """`check_launch_inputs(create=False)` where the folder of `out` is missing: what can be
    told without making it (the deepest existing part of its path is a directory, on a file
    system that stores files, writable and searchable; `out` would not name a directory).

    Raises:
        ValueError: one of these fails (names the part of the path and the reason).
    """
    folder = os.path.dirname(out)
    existing = _check_deepest_existing(folder,
                                       f"{flag} {out!r}: cannot create its folder {folder!r}")
    # what `out` names once the missing folders exist: they are made as real directories,
    # so ".." in the part of the path still missing is lexical
    rest = os.path.normpath(out[len(existing):].lstrip(os.sep))
    if os.path.isdir(os.path.join(existing, rest) if existing else rest):
        raise ValueError(f"{flag} {out!r} is a directory: give a file path")


def _deepest_existing(path: str) -> str:
    """The longest leading part of `path` that exists ("" where none does: the current
    directory's)."""
    existing = path
    while existing and not os.path.lexists(existing):
        parent = os.path.dirname(existing)
        existing = "" if parent == existing else parent
    return existing


def _check_deepest_existing(path: str, what: str) -> str:
    """Check that the deepest existing part of `path` (`_deepest_existing`) is a writable,
    searchable directory of a file system that stores files; returns that part.

    Raises:
        ValueError: it is not (the message starts with `what`, names the part and why).
    """
    existing = _deepest_existing(path)
    here = existing or os.curdir
    if not os.path.isdir(here):
        raise ValueError(f"{what}: {here!r} is not a directory")
    kind = pseudo_file_system(here)
    if kind is not None:
        raise ValueError(f"{what}: {here!r} is on the kernel's {kind} file system")
    try:
        read_only = bool(os.statvfs(here).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        read_only = False
    if read_only or not os.access(here, os.W_OK | os.X_OK):
        reason = "Read-only file system" if read_only else "Permission denied"
        raise ValueError(f"{what} ({reason}: {here!r})")
    return existing


def check_folder(folder: str, flag: str) -> None:
    """An output folder named by option `flag` (e.g. a launcher's `--trace-dir`) that a run
    will write files into: an existing one must be a writable directory of a file system
    that stores files; a missing one must be creatable (the deepest existing part of its
    path such a directory). Nothing is created.

    Raises:
        ValueError: it names something else than a directory (or a part of its path does),
            lies on a kernel file system (`PSEUDO_FILE_SYSTEMS`), or is not writable (names
            the part of the path and the reason).
    """
    if not folder:
        raise ValueError(f"{flag}: expected a folder, got an empty path")
    missing = not os.path.lexists(folder)
    _check_deepest_existing(folder, f"{flag} {folder!r}" + (": cannot create it" if missing
                                                             else ""))


def check_launch_inputs(out: str, flag: str = "--out", *, create: bool = True) -> None:
    """What every launcher checks before any work: each `MEGATRON_OVERLAP_*` variable
    (`megatron_overlap.config.check_environment`), that the results file `out` does not
    name a directory, that its folder exists or can be created, and that the file can be
    opened for appending (otherwise found only when the rows are written; a file made for
    the check is removed). An existing `out` (symbolic links followed) must be a regular
    file, a FIFO or a character device (e.g. /dev/null), and not a file of a kernel file
    system such as /proc (`PSEUDO_FILE_SYSTEMS`: root can open `/proc/version` for
    appending, but writing a row to it fails).

    Args:
        out: the results file ("": only the variables are checked).
        flag: the option named in the messages.
        create: True (the default): a missing folder of `out` is created here. False:
            nothing is created (a run refused after this check leaves no new folder); a
            missing folder is only checked to be creatable (the deepest existing part of
            its path is a writable directory) and the launcher makes it with
            `make_folder(out, flag)` once the run proceeds.

    Raises:
        ValueError: a bad variable, `out` is an existing directory or not a regular file
            (a block device, a socket, a /proc file), its folder cannot be created (a path
            component is a file, no permission; the OS's reason named), or the file cannot
            be written.
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
        if not create and not os.path.isdir(folder):
            _check_folder_can_be_made(out, flag)
            return  # no file can exist in a missing folder: nothing more to open
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
    _check_existing_kind(out, flag)
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


def _check_existing_kind(out: str, flag: str) -> None:
    """An existing `out` (links followed) is a regular file of a file system that stores
    files, a FIFO or a character device; a missing one passes.

    Raises:
        ValueError: anything else (a block device, a socket, a file of /proc or /sys).
    """
    import stat

    try:
        mode = os.stat(out).st_mode
    except OSError:
        return  # missing (or unreadable: the open below names the reason)
    if stat.S_ISREG(mode):
        kind = pseudo_file_system(out)
        if kind is not None:
            raise ValueError(f"{flag} {out!r} cannot be written: it is a file of the "
                             f"kernel's {kind} file system, expected a regular file to "
                             "append rows to")
        return
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        return
    what = "a block device" if stat.S_ISBLK(mode) else (
        "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise ValueError(f"{flag} {out!r} cannot be written: it is {what}, expected a regular "
                     "file to append rows to")


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
