"""Where a rank's failure becomes the exception the caller sees, and which failure that is.

Every outcome (the local backend's, a Ray call's, a session cell's) collects one
:class:`RankFailure` per failed rank and hands them here. :func:`root_cause_order`
is the one rule that picks the root cause: a rank's *own* failure (an exception
of its own, a death by a signal, a lost node) comes before the *collateral*
errors of its peers (torch.distributed's errors when a peer vanished; a cell's
rank interrupted because another failed), then time decides (one clock: each
node's monotonic clock turned into wall-clock time by the caller). A SIGKILL is
seen only after the fact, so one seen soon after the earliest exception is
taken to have come first. :func:`build_exception` turns the root cause into the
user's own exception type when that can be rebuilt, with the rank's traceback
as ``__cause__``, or into a :class:`RankFailedError`; the others go in a note.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

from air_magic.errors import AirMagicError, RankFailedError, RemoteTraceback, add_note
from air_magic.protocol import elastic_error_file, serialization, wire
from air_magic.protocol.wire import ErrorRecord

# What a signal death most likely means, for the message.
_SIGNAL_HINTS = {
    signal.SIGKILL: "often the kernel's out-of-memory killer (check `dmesg` or `journalctl -k`), "
    "or someone ran `kill -9`",
    signal.SIGSEGV: "a crash in native code (a C/C++/CUDA extension); faulthandler wrote the rank's "
    "Python stack to its log",
    signal.SIGABRT: "an abort in native code (a failed C++ assertion, NCCL or CUDA error); see the log",
    signal.SIGBUS: "often a full /dev/shm (shared memory for DataLoader workers)",
    signal.SIGTERM: "something outside air_magic asked it to stop",
    signal.SIGINT: "an interrupt sent to the rank itself",
}


# A SIGKILL is only seen after the fact (a loop's pidfd wakes late under load), while an
# exception is stamped when it is raised. A peer's collective error follows the death it was
# caused by, and nothing a peer raises SIGKILLs a rank: a SIGKILL seen this soon after the
# earliest exception came first.
SIGKILL_SEEN_LATE_S = 1.5

# What a rank raises when *another* rank failed: torch.distributed's errors, and the words of
# gloo, NCCL, c10d and the store in a RuntimeError when a peer vanished. Whole words only: a user's
# "Failed to restore checkpoint" or "DataLoader timed out" is the user's own failure.
_COLLATERAL_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_COLLATERAL_WORDS = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|socket timeout"
    r"|\b(gloo|nccl|c10d|processgroup\w*|tcpstore)\b",
    re.IGNORECASE,
)


def is_collateral(type_name: str, message: str) -> bool:
    """An error a rank raises because another one failed (so it is not the root cause)."""
    short = type_name.rsplit(".", 1)[-1]
    if short in _COLLATERAL_TYPES:
        return True
    return short == "RuntimeError" and _COLLATERAL_WORDS.search(message) is not None


@dataclass
class RankFailure:
    """One failed rank. ``time`` (one clock for every rank) orders failures; ``record`` is set when
    the rank reported itself; ``collateral``: a consequence of another rank's failure (see
    :func:`root_cause_order`); ``lost``: what happened to its node, when the node was lost."""

    rank: int
    time: float
    exit_code: int | None
    record: ErrorRecord | None
    collateral: bool = False
    lost: str | None = None

    @classmethod
    def of(
        cls,
        rank: int,
        time: float,
        exit_code: int | None,
        record: ErrorRecord | None,
        *,
        consequence: bool = False,
    ) -> RankFailure:
        """A failure, marked collateral when its record says so (or the caller knows it is a consequence)."""
        collateral = consequence or (record is not None and is_collateral(record.type_name, record.message))
        return cls(rank, time, exit_code, record, collateral=collateral)


def root_cause_order(failures: list[RankFailure]) -> list[RankFailure]:
    """The failures, root cause first: own failures before collateral ones, then time, then rank."""
    reported = [f.time for f in failures if f.record is not None and not f.collateral]
    if reported:
        first = min(reported)
        for f in failures:
            if f.record is None and f.exit_code == -signal.SIGKILL and f.time <= first + SIGKILL_SEEN_LATE_S:
                f.time = min(f.time, first - 1e-6)
    return sorted(failures, key=lambda f: (f.collateral, f.time, f.rank))


def root_cause_rank(error: BaseException | None) -> int | None:
    """The root cause's rank of an error :func:`build_exception` made (or of its cause: a session's
    end raised over a rank's failure); None for any other error. What a call's RunFinished names,
    so a tab, a history line and a tag never name another rank than the exception does."""
    while error is not None:
        failures = getattr(error, "air_magic_failures", None)
        if failures:
            return int(failures[0][0])
        error = error.__cause__
    return None


def build_exception(
    failures: list[RankFailure],
    *,
    world_size: int,
    log_path: Callable[[int], str],
    last_lines: Callable[[int], list[str]],
    cpu_mode: bool = False,
) -> BaseException:
    """The error for the root cause (:func:`root_cause_order`); the others are summed up in a note.

    ``cpu_mode``: the call ran on the CPU because no GPU is visible; a failure that needed CUDA
    (the seed's own quickstart calls ``torch.cuda.set_device``) gets a note that says why.

    Every failure, root cause first, is on the exception as ``air_magic_failures``:
    ``(rank, time, summary)`` tuples.
    """
    ordered = root_cause_order(failures)
    failure = ordered[0]
    if failure.lost is not None:  # with its node: the ranks lost with it are one failure
        lost = [f for f in ordered if f.lost == failure.lost]
        others = [f for f in ordered if f.lost != failure.lost]
        exc: BaseException = _lost_error(lost, others, log_path, last_lines(failure.rank))
    else:
        others = ordered[1:]
        exc = _exception_for(failure, world_size, log_path(failure.rank), last_lines(failure.rank))
    summary = [(f.rank, f.time, _summary(f)) for f in ordered]
    extra: list[str] = []
    if cpu_mode and needs_cuda(failure):
        extra.append(CPU_MODE_HINT)
        add_note(exc, CPU_MODE_HINT)
    if others and failure.lost is None:
        shown = "; ".join(f"rank {f.rank}: {_summary(f)}" for f in others[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        extra.append(f"[air_magic] after it, {len(others)} other rank(s) failed too: {shown}{more}")
        add_note(exc, extra[-1])
    _set(exc, "air_magic_failures", summary)
    rendered = getattr(exc, "_render_traceback_", None)
    # Our own errors render their notes themselves (and must pickle without a lambda on them).
    if rendered is not None and extra and not isinstance(exc, AirMagicError):
        lines = rendered()
        _set(exc, "_render_traceback_", lambda: [*lines, *extra])
    return exc


CPU_MODE_HINT = (
    "[air_magic] this call ran on the CPU: no NVIDIA GPU is visible here, and this rank's code needs "
    "CUDA. Use air_magic.init_process_group() (gloo and the CPU here, NCCL and the rank's GPU on a GPU "
    "machine) and the device it returns, or init_process_group('gloo') and torch.device('cpu')."
)
# What torch (and NCCL) say when CUDA is asked for where there is none.
_NEEDS_CUDA = re.compile(
    r"torch\.cuda|_cuda_|\.cuda\(|Torch not compiled with CUDA|CUDA driver|no NVIDIA driver|"
    r"NVIDIA driver on your system|nccl|NCCL|cuda:\d|device='cuda|device=\"cuda|CUDA error|CUDA available",
)


def needs_cuda(failure: RankFailure) -> bool:
    """The rank failed for want of CUDA (judged from its exception and traceback)."""
    record = failure.record
    if record is None:
        return False
    return bool(_NEEDS_CUDA.search(f"{record.type_name}: {record.message}\n{record.traceback}"))


def raised_on_its_own(record: bytes | None) -> bool:
    """A rank's error record (as written) holds an exception of its own: not the interrupt or the
    exit that stopping it raises. Such a rank failed, even if it raised after the stop began."""
    try:
        type_name = serialization.loads(record).type_name if record is not None else ""
    except Exception:  # noqa: BLE001 - a torn record: it did fail, but how is unknown
        return False
    return bool(type_name) and type_name not in ("builtins.KeyboardInterrupt", "builtins.SystemExit")


def _lost_error(
    lost: list[RankFailure], others: list[RankFailure], log_path: Callable[[int], str], last_lines: list[str]
) -> RankFailedError:
    first = lost[0]
    ranks = ", ".join(str(f.rank) for f in lost)
    tail = "\n".join(f"    {line}" for line in last_lines) or "    (nothing)"
    log_dir = os.path.dirname(log_path(first.rank))
    message = (
        f"{first.lost}, and rank(s) {ranks} with it (the node died, its raylet was killed, or the agent "
        f"was killed). Every other rank was stopped.\n  Last lines of rank {first.rank}:\n{tail}\n"
        f"  Logs: {log_dir}"
    )
    if others:
        message += f"\n  {len(others)} other rank(s) failed after it (collective errors)."
    return RankFailedError(message, rank=first.rank, exit_code=None, log_dir=log_dir)


def _summary(failure: RankFailure) -> str:
    if failure.lost is not None:
        return failure.lost
    if failure.record is not None:
        return f"{failure.record.type_name.rsplit('.', 1)[-1]}: {failure.record.message}"[:200]
    return exit_words(failure.exit_code)


def _exception_for(
    failure: RankFailure, world_size: int, log_path: str, last_lines: list[str]
) -> BaseException:
    rank = failure.rank
    where = f"rank {rank} of {world_size}"
    record = failure.record
    if record is not None:
        header = f"Traceback from {where} (full log: {log_path}):\n"
        cause = RemoteTraceback(header + record.traceback.rstrip("\n"))
        exc = _rebuild(record)
        # SystemExit or KeyboardInterrupt from a rank must not end the caller: wrap those. Other
        # BaseExceptions (torch's CheckpointException) are the rank's own errors: raised as they are.
        if exc is not None and not isinstance(exc, _ENDS_A_PROCESS):
            note = f"[air_magic] raised on {where}; full log: {log_path}"
            if record.stage == "write":
                note = (
                    f"[air_magic] {where} returned, but its result could not be written to the run folder "
                    f"(is the temp folder full? TMPDIR moves it); full log: {log_path}"
                )
            add_note(exc, note)
            _set(exc, "air_magic_rank", rank)
            # IPython shows this instead of air_magic's frames in the kernel.
            rendered = [*cause.text.splitlines(), note]
            _set(exc, "_render_traceback_", lambda: rendered)
            exc.__cause__ = cause
            return exc
        stage = {"load": " while loading the function and its arguments"}.get(record.stage, "")
        if exc is not None:  # SystemExit, KeyboardInterrupt...: raised here, they would end this process
            message = (
                f"{where} raised {type(exc).__name__}({record.message}){stage}. A rank ends by returning "
                f"or raising; {type(exc).__name__} is reported as a failure so that it cannot end this "
                "process too."
            )
            if isinstance(exc, SystemExit):
                message += " (sys.exit() in the function? Return instead.)"
        elif record.stage == elastic_error_file.STAGE:
            message = (
                f"{where} raised {record.type_name}: {record.message}. (From its TORCHELASTIC_ERROR_FILE, "
                "written by torch's @record: the rank ended before it could report the exception itself.)"
            )
        else:
            message = (
                f"{where} raised {record.type_name}: {record.message}{stage}. "
                "(The exception itself could not be sent back, so its text is shown instead.)"
            )
        err = RankFailedError(
            message,
            rank=rank,
            exit_code=failure.exit_code,
            log_dir=log_path,
            remote_traceback=record.traceback,
        )
        err.__cause__ = cause
        return err
    return RankFailedError(
        _death_message(where, failure.exit_code, log_path, last_lines),
        rank=rank,
        exit_code=failure.exit_code,
        log_dir=log_path,
    )


_ENDS_A_PROCESS = (SystemExit, KeyboardInterrupt, GeneratorExit)


def _rebuild(record: ErrorRecord) -> BaseException | None:
    if record.exception is None:
        return None
    try:
        exc = serialization.loads(record.exception)
    except Exception:  # noqa: BLE001 - e.g. the class exists only in the rank
        return None
    return exc if isinstance(exc, BaseException) else None


def _set(exc: BaseException, name: str, value: object) -> None:
    # Some exception types refuse new attributes (__slots__); they go without.
    try:
        setattr(exc, name, value)
    except (AttributeError, TypeError):
        pass


def exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code is None:
        return "ended without a result; its exit status was lost (the warm starter died)"
    return f"exited with status {code} without a result"


def _death_message(where: str, code: int | None, log_path: str, last_lines: list[str]) -> str:
    if code is None:
        what = (
            f"{where} ended without returning a result, and its exit status is unknown: the warm "
            "starter, which reports it, died during the call (see starter.log in the log folder's parent)"
        )
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = _SIGNAL_HINTS.get(-code)  # type: ignore[call-overload]
        what = f"{where} was killed by {name}" + (f": {hint}" if hint else "")
    elif code == 0:
        what = (
            f"{where} exited with status 0 without returning a result "
            "(did something call os._exit(0), or end the interpreter from a thread?)"
        )
    elif any(wire.ERROR_RECORD_UNWRITTEN in line for line in last_lines):
        what = (
            f"{where} failed (status {code}), and its error record could not be written to the call "
            "folder (is the temp folder full?): its traceback is in the last lines below"
        )
    else:
        what = (
            f"{where} exited with status {code} without returning a result "
            "(sys.exit() or os._exit() in the function or a library, or a crash before it started)"
        )
    tail = "\n".join(f"    {line}" for line in last_lines) if last_lines else "    (it printed nothing)"
    return f"{what}.\n  Last lines it printed:\n{tail}\n  Full log: {log_path}"
