"""The one error tree of air_magic, and how a rank's failure becomes an exception.

Every error the package raises on purpose is defined here::

    AirMagicError
    ├── ConfigurationError (also ValueError)   bad settings, caught before launch
    │   └── AcceleratorError                   asked for GPUs the machine does not have
    ├── PayloadError (also TypeError)          the function, arguments or result cannot travel
    ├── DirectCallError (also TypeError)       ``fn(...)`` instead of ``fn.distributed(...)``
    ├── LaunchError                            a rank process could not be started
    ├── DistributedTimeoutError (also TimeoutError)
    └── RankFailedError                        a rank died, or its exception cannot be rebuilt

    RemoteTraceback                            carries a rank's traceback text as ``__cause__``
    StopSignal (a KeyboardInterrupt)           a stop signal to the command line, forwarded to the ranks

When a rank raises, the caller re-raises the *original* exception type when it
can be unpickled (loky's approach), with the rank's formatted traceback as its
``__cause__`` so a notebook shows the rank's frames, and a note naming the rank.

Every error here survives a pickle round trip (a detached run's result travels to
whoever attaches as a pickle): :meth:`AirMagicError.__reduce__` rebuilds it without
calling ``__init__`` (whose keyword-only arguments plain pickling cannot pass), with
its attributes, notes and a rank's traceback (``__cause__``) kept.
"""

from __future__ import annotations


class AirMagicError(Exception):
    """Base class of every error air_magic raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing our internal frames: the message
        # (and a rank's traceback, when there is one) is what a person needs.
        lines: list[str] = []
        if isinstance(self.__cause__, RemoteTraceback):
            lines += [*self.__cause__.text.splitlines(), ""]
        lines += f"{type(self).__name__}: {self}".splitlines()
        lines += [str(n) for n in getattr(self, "__notes__", ())]
        return lines

    def __reduce__(self) -> tuple[object, ...]:
        # BaseException's own reduce calls ``type(*args)``: an error with keyword-only
        # arguments (RankFailedError, DistributedTimeoutError) could not be rebuilt, and a
        # detached run's follower died reading its result. The cause travels only when it is
        # a rank's traceback (text); any other cause may not be picklable.
        cause = self.__cause__ if isinstance(self.__cause__, RemoteTraceback) else None
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__), cause))


def _rebuild_error(
    cls: type[AirMagicError], args: tuple[object, ...], state: dict[str, object], cause: BaseException | None
) -> AirMagicError:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    if cause is not None:
        err.__cause__ = cause
    return err


class ConfigurationError(AirMagicError, ValueError):
    """A setting is invalid; nothing was launched."""


class AcceleratorError(ConfigurationError):
    """The requested accelerators do not match what this machine has."""


class PayloadError(AirMagicError, TypeError):
    """The function, its arguments or a rank's result cannot be sent."""


class DirectCallError(AirMagicError, TypeError):
    """A decorated function was called directly instead of through ``.distributed()``."""


class LaunchError(AirMagicError):
    """A rank process could not be started."""


class SessionEndedError(LaunchError):
    """A persistent session's ranks are gone (a rank died, or did not recover from an interrupt)."""


class DistributedTimeoutError(AirMagicError, TimeoutError):
    """The call ran past its ``timeout``; every rank was stopped."""

    def __init__(self, message: str, *, still_running: list[int], log_dir: str | None = None):
        super().__init__(message)
        self.still_running = still_running
        self.log_dir = log_dir


class RankFailedError(AirMagicError):
    """A rank failed in a way that has no rebuildable Python exception.

    That is: it was killed by a signal, exited without a result, or raised an
    exception whose type could not be sent back. ``rank``, ``exit_code`` and
    ``log_dir`` say which, how and where to look.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exit_code: int | None = None,
        log_dir: str | None = None,
        remote_traceback: str | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.log_dir = log_dir
        self.remote_traceback = remote_traceback


class StopSignal(KeyboardInterrupt):
    """A stop that came as a signal (SIGTERM, SIGHUP or SIGINT to ``air-magic run``): the ranks get
    the same signal, as torchrun forwards it, then the call's ``stop_grace`` before SIGKILL."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class RemoteTraceback(Exception):
    """The formatted traceback of a rank, attached as ``__cause__`` of the re-raised error."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


def add_note(exc: BaseException, note: str) -> None:
    """``BaseException.add_note`` on 3.11+, the same attribute by hand on 3.10."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            try:
                exc.__notes__ = notes
            except AttributeError:
                return
        notes.append(note)
