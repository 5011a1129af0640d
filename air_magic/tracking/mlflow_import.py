"""``import mlflow``: once per process, only when tracking is on, never on the caller's thread.

``import mlflow`` costs seconds, so it happens only here, and only for a call
that is tracked. Without mlflow installed a call runs untracked, with a one-line
note (once per process).

Why a helper thread: a KeyboardInterrupt (Ctrl-C, the notebook's stop button)
lands wherever the caller's thread happens to be, and one half-way through
``import mlflow`` leaves half-initialised modules that break every later call.
Signals reach only the main thread, so the import runs on another one and an
interrupt stops only the wait.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

from air_magic.threads import start_in_context

_missing_said = False  # the note "MLflow is not installed" is said once per process
_imported: threading.Event | None = None  # set when the thread importing mlflow is done
_import_failure: BaseException | None = None


def import_mlflow() -> ModuleType | None:
    """``mlflow``, imported once per process on a helper thread; None when it cannot be imported.

    ``import mlflow`` takes seconds, and a KeyboardInterrupt inside it leaves half-initialised
    mlflow and sqlalchemy modules in ``sys.modules``: every later ``import mlflow`` then fails
    (``partially initialized module``) until a restart. Signals reach only the main thread, so
    the import runs on another one and an interrupt stops only the wait. An import that fails
    anyway is cleaned up (:func:`_forget_orphans`) and tried again on the next call.

    The wait is on an Event, not ``Thread.join``: a join that an interrupt stops marks the
    thread as stopped though it still runs (CPython 3.11), and the next join would not wait.
    """
    global _imported, _missing_said
    imported = _imported
    if imported is None:
        imported = _imported = threading.Event()
        # What the import prints goes to the caller's cell (threads.py).
        start_in_context(_import_in_background, "air_magic-import-mlflow", imported)
    imported.wait()
    failure = _import_failure
    if failure is None:
        return sys.modules["mlflow"]
    _imported = None  # the next call tries again
    if not _missing_said:
        _missing_said = True
        if isinstance(failure, ImportError):
            why = "MLflow is not installed" + ("" if failure.name == "mlflow" else f" ({failure})")
        else:
            why = f"MLflow could not be imported ({type(failure).__name__}: {failure})"
        print(
            f"air_magic: {why}, so calls are not tracked "
            "(pip install 'air_magic[mlflow]', or tracking=False to silence this)",
            file=sys.stderr,
        )
    return None


def _import_in_background(done: threading.Event) -> None:
    global _import_failure
    before = set(sys.modules)
    try:
        import mlflow  # noqa: F401
        from mlflow.tracking import MlflowClient  # noqa: F401

        _import_failure = None
    except BaseException as exc:  # noqa: BLE001 - said on the caller's thread
        _import_failure = exc
        _forget_orphans(set(sys.modules) - before)
    finally:
        done.set()


def _forget_orphans(new_modules: set[str]) -> None:
    """Drop the modules of a failed import whose parent package did not survive it.

    Python drops the module that failed, and its parents; submodules that had finished stay,
    bound to a parent object no longer in ``sys.modules``, and a fresh import of the parent
    would skip them (``has no attribute``). Complete top-level modules stay: importing a C
    extension twice is worse than keeping it.
    """
    for name in sorted(new_modules, key=lambda n: n.count(".")):
        parts = name.split(".")
        parents = (".".join(parts[:i]) for i in range(1, len(parts)))
        if any(parent not in sys.modules for parent in parents):
            sys.modules.pop(name, None)
