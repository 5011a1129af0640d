"""The command line: ``air-magic run TARGET`` (and ``python -m air_magic run``), a third surface (SPEC §12).

``air-magic run [options] TARGET [ARGS...]`` runs TARGET on every rank, as the
decorator and the magic do, through the same call layer (calls/call.py):

- ``script.py``: run as ``__main__`` in every rank with ``sys.argv = [script,
  *ARGS]``, so a script written for torchrun runs unchanged;
- ``-m module``: ``python -m module ARGS`` in every rank;
- ``module:function``: called on every rank with ARGS (strings); each rank's
  return value is printed at the end, one line per rank;
- ``notebook.ipynb``: its code cells in order in an IPython shell of this
  process, as a kernel would run them: ``%%distributed`` cells on the ranks
  (with the options of their own ``%%distributed`` line), the others here.

The options are the settings schema's (launch/settings.py), as the magic's are,
plus ``--json``. Output is ``[rank N]`` lines (a colour per rank on a terminal),
or with ``--json`` one JSON object per event (display/json_lines.py). The exit
status says how the call ended: 0; the root-cause rank's status (1 for an
exception, 128+N for signal N); 124 on timeout; 130 on SIGINT, 143 on
SIGTERM and 129 on SIGHUP (each is forwarded to every rank, which gets ``--stop-grace``
seconds, default 30 or ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, to end before SIGKILL, as under
torchrun; a second signal kills at once); 2 for a bad TARGET or option.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import shutil
import signal
import sys
import traceback
import warnings
from dataclasses import replace
from types import FrameType
from typing import Any

from air_magic import torchrun_flags, verbs
from air_magic.calls import anywhere, history, ray_jobs, runners
from air_magic.calls.call import prepare_call, run_call, start_async
from air_magic.display.json_lines import JsonLines
from air_magic.display.text import TextDisplay
from air_magic.errors import (
    ConfigurationError,
    DistributedTimeoutError,
    LaunchError,
    RankFailedError,
    RemoteTraceback,
    StopSignal,
)
from air_magic.launch.settings import add_arguments, make_settings, settings_from_args
from air_magic.protocol import env_names
from air_magic.protocol.events import Consumer, Outcome
from air_magic.tracking import store
from air_magic.worker import targets

USAGE_ERROR = 2  # argparse's own status for a bad option
TIMEOUT = 124  # as timeout(1)
SIGNALLED = 128  # + the signal's number, as a shell reports it


class UsageError(Exception):
    """A bad TARGET or option: one line on stderr, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(argv)
        sys.stdout.flush()  # here: a closed pipe found at exit would print Python's own complaint
        return status
    except BrokenPipeError:  # `air-magic runs | head`: the reader has what it wanted
        # Python would complain again when it flushes stdout at exit: point it at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else USAGE_ERROR
    handler = verbs.handler(argv[0], "cli")
    if handler is None:
        parser.print_usage(sys.stderr)
        commands = ", ".join(verbs.names("cli"))
        print(f"air-magic: unknown command {argv[0]!r} (commands: {commands})", file=sys.stderr)
        return USAGE_ERROR
    try:  # the verb's words, parsed by its spec first (verbs.py): a bad one runs nothing
        status: int = handler(verbs.parse(argv[0], "cli", argv[1:]))
    except (UsageError, ConfigurationError) as exc:
        print(f"air-magic {argv[0]}: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return status


@verbs.handles("run", "cli")
def _run_command(argv: list[str]) -> int:
    """``run [options] TARGET [ARGS]``; a bad TARGET or option (UsageError) is _main's to print."""
    try:
        options, target = _split_run_arguments(argv)
        args = _run_parser().parse_args(options)
        if target is None:
            raise UsageError("run needs a TARGET: script.py, -m module, module:function or notebook.ipynb")
        given = settings_from_args(args)
        try:
            torchrun = torchrun_flags.read(args, given)
        except torchrun_flags.TorchrunUsageError as exc:
            raise UsageError(str(exc)) from None
        for note in torchrun.notes:
            print(f"air-magic run: {note}", file=sys.stderr)
        if torchrun.force_cpu:
            os.environ[env_names.FORCE_CPU] = "1"  # read where the call is planned, in this process
        store.name_calls_after(_experiment_of(*target[:2]))
        _check_torchrun_fits(target[0], torchrun, given)
        if target[0] == "notebook":
            return _run_notebook(target[1], target[2], args)
        call = _target(*target)
        if torchrun.env:
            given["env"] = {**torchrun.env, **(given.get("env") or {})}  # --env wins
        settings = make_settings(**{**given, **torchrun.settings}, display="none")
    except ConfigurationError as exc:  # a bad setting: one line, as for a bad option
        print(f"air-magic run: {str(exc).splitlines()[0]}", file=sys.stderr)
        return USAGE_ERROR
    return _run(call, settings, args, torchrun)


# -- arguments ---------------------------------------------------------------------------


def _check_torchrun_fits(kind: str, torchrun: torchrun_flags.TorchrunLine, given: dict[str, Any]) -> None:
    """A notebook's cells carry their own options; a detached run is followed elsewhere: the
    torchrun options that would change nothing there are refused, not dropped."""
    if kind == "notebook" and torchrun.given - {"standalone", "run-path", "monitor-interval"}:
        raise UsageError(
            "a notebook target takes no torchrun options (its %%distributed lines carry the options): "
            + ", ".join(f"--{name}" for name in sorted(torchrun.given))
        )
    refused = [
        flag
        for flag, used in (
            ("--max-restarts", bool(torchrun.max_restarts)),
            ("--local-ranks-filter", torchrun.console_ranks is not None),
        )
        if used
    ]
    if given.get("detach") and refused:
        raise UsageError(
            f"--detach cannot be combined with {' or '.join(refused)}: a detached run makes one attempt "
            "and its followers show every rank (drop the option, or run without --detach)"
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="air-magic",
        description="Run PyTorch training on every GPU of this machine (or a Ray cluster).",
    )
    parser.add_argument("command", choices=verbs.names("cli"), help="one of the commands below")
    parser.epilog = "commands:\n" + verbs.help_text("cli") + "\n\nair-magic run --help: the options of a run"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="air-magic run",
        usage="air-magic run [options] (script.py | -m module | module:function | notebook.ipynb) [ARGS...]",
        description="Run TARGET on every rank, as @distributed does (options: the decorator's settings).",
    )
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per event on stdout")
    torchrun_flags.add_to(parser)
    parser.error = _usage_error  # type: ignore[method-assign]
    return parser


def _usage_error(message: str) -> Any:
    raise UsageError(message)


def _split_run_arguments(argv: list[str]) -> tuple[list[str], tuple[str, str, list[str]] | None]:
    """Options, and the target: ``(kind, what, ARGS)``. Everything after the target is ARGS,
    options included (they are the script's), as with ``python`` and torchrun."""
    takes_value = _options_with_values()
    # torchrun's --module and --no-python say what TARGET is (also as PET_MODULE, PET_NO_PYTHON).
    kind = (
        "program"
        if torchrun_flags.flag_from_env("no-python")
        else "module"
        if torchrun_flags.flag_from_env("module")
        else None
    )
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m":
            if i + 1 >= len(argv):
                raise UsageError("-m needs a module name")
            return argv[:i], ("module", argv[i + 1], argv[i + 2 :])
        if token == "--":
            rest = argv[i + 1 :]
            return argv[:i], (kind or _kind_of(rest[0]), rest[0], rest[1:]) if rest else None
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            if name in ("--no-python", "--no_python"):
                kind = "program"
            elif name == "--module" and kind is None:
                kind = "module"
            i += 2 if name in takes_value and "=" not in token else 1
            continue
        return argv[:i], (kind or _kind_of(token), token, argv[i + 1 :])
    return argv, None


def _options_with_values() -> set[str]:
    parser = _run_parser()
    return {flag for action in parser._actions if action.nargs != 0 for flag in action.option_strings}


def _kind_of(target: str) -> str:
    if target.endswith(".ipynb"):
        return "notebook"
    if target.endswith(".py") or os.path.isfile(target):
        return "script"
    if ":" in target:
        return "function"
    raise UsageError(f"TARGET {target!r} is not a file; give script.py, -m module, or module:function")


def _target(kind: str, what: str, argv: list[str]) -> tuple[str, Any, inspect.BoundArguments, str]:
    """The call's name, its function (air_magic.worker.targets) and bound arguments, its source kind."""
    if kind == "script":
        if not os.path.isfile(what):
            raise UsageError(f"no such script: {what}")
        fn: Any = targets.run_script
        args: tuple[Any, ...] = (os.path.abspath(what), argv, what)  # argv[0]: as typed, as torchrun
        name = os.path.basename(what)
    elif kind == "module":
        _check_module(what)
        fn, name, args = targets.run_module, what, (what, argv)
    elif kind == "program":
        found = shutil.which(what)
        if found is None:
            raise UsageError(f"no such program: {what} (--no-python runs TARGET as a program)")
        fn, name, args = targets.run_program, os.path.basename(what), (found, argv)
    else:
        module, _, function = what.partition(":")
        if not module or not function:
            raise UsageError(f"TARGET {what!r}: give module:function")
        _check_function(module, function)
        fn, name, args = targets.call_function, what, (what, argv)
    return name, fn, inspect.signature(fn).bind(*args), kind


def _experiment_of(kind: str, what: str) -> str:
    """The default MLflow experiment of TARGET: a script's or notebook's file name without its
    suffix, a module's name (``pkg.train``, ``mymod`` of ``mymod:main``), as docs/cli.md says."""
    if kind in ("script", "notebook", "program"):
        return os.path.splitext(os.path.basename(what))[0]
    return what.partition(":")[0]


def _check_module(module: str) -> Any:
    sys.path.insert(0, os.getcwd())  # as the ranks will see it
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.pop(0)
    if found is None:
        raise UsageError(f"no module named {module!r}")
    return found


def _check_function(module: str, qualname: str) -> None:
    """``module:function`` names something the module defines, checked before any rank starts.

    Read from the module's source (``ast``), not imported: importing it here would run its
    top level (and import torch) in this process. A module whose names cannot be read that way
    (no source, ``from x import *``, a module ``__getattr__``) is left to the ranks."""
    import ast

    origin = getattr(_check_module(module), "origin", None)
    if not origin or not origin.endswith(".py"):
        return
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return  # the ranks report it, with the rank's own traceback
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        else:
            for target in ast.walk(node):  # assignments, also under if/try at the top level
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    defined.add(target.id)
                elif isinstance(target, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(target.name)
    if "__getattr__" in defined:
        return
    first = qualname.split(".")[0]
    if first not in defined:
        raise UsageError(f"module {module!r} ({origin}) defines no {first!r}")


# -- runs and logs ----------------------------------------------------------------------
# Each verb's arguments are its row of the table (verbs.py), parsed there before its handler runs.


@verbs.handles("runs", "cli")
def _runs(args: argparse.Namespace) -> int:
    for line in verbs.runs(args.log_dir, args.n, cluster=ray_jobs.cluster_address(args.cluster)):
        print(line)
    return 0


@verbs.handles("logs", "cli")
def _logs(args: argparse.Namespace) -> int:
    text = verbs.logs(args.run, args.rank, args.log_dir, cluster=ray_jobs.cluster_address(args.cluster))
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
    return 0


# -- running -----------------------------------------------------------------------------


def _run(
    call: tuple[str, Any, inspect.BoundArguments, str],
    settings: Any,
    args: argparse.Namespace,
    torchrun: torchrun_flags.TorchrunLine | None = None,
) -> int:
    torchrun = torchrun or torchrun_flags.TorchrunLine()
    name, fn, bound, kind = call
    source = _read(bound.args[0]) if kind == "script" else None  # the run keeps the script's text
    if runners.outlives_caller(settings):  # started and left: its supervisor runs it
        return _start_detached(name, fn, bound, settings, kind, source)
    json_out = JsonLines() if args.json else None
    consumers = _displays(args, json_out, torchrun.console_ranks)
    stopped_by: list[int] = []
    previous = _stop_on_signals(stopped_by)
    values: list[Any] | None = None
    error: BaseException | None = None
    try:
        attempt = 0
        while True:
            # torchrun's --max-restarts: after a failure every rank starts again, counted in
            # TORCHELASTIC_RESTART_COUNT, recorded in the same MLflow run (resumed).
            this = replace(
                settings,
                env={
                    **settings.env,
                    "TORCHELASTIC_RESTART_COUNT": str(attempt),
                    "TORCHELASTIC_MAX_RESTARTS": str(torchrun.max_restarts),
                },
            )
            result = run_call(name, fn, bound, this, kind=kind, source=source, consumers=consumers)
            if result.outcome != Outcome.FAILED or attempt >= torchrun.max_restarts:
                break
            attempt += 1
            said = str(result.error).strip().splitlines()[0] if result.error is not None else "failed"
            print(
                f"air-magic run: attempt {attempt} of {torchrun.max_restarts + 1} failed ({said}); "
                f"every rank starts again (TORCHELASTIC_RESTART_COUNT={attempt})",
                file=sys.stderr,
                flush=True,
            )
            last = history.last_run()
            if last is not None and last.mlflow_run_id and settings.mlflow_run_id is None:
                settings = replace(settings, mlflow_run_id=last.mlflow_run_id)
        values = result.unwrap()
        status = 0
    except KeyboardInterrupt as exc:  # every rank was stopped before this came up
        error = exc
        status = SIGNALLED + (stopped_by[0] if stopped_by else signal.SIGINT)
    except BaseException as exc:  # noqa: BLE001 - every way a call fails becomes an exit status
        error = exc
        status = exit_status(exc)
    finally:
        _restore(previous)
    _report(kind, values, error, status, json_out)
    return status


def _displays(
    args: argparse.Namespace, json_out: JsonLines | None, console_ranks: set[int] | None = None
) -> list[Consumer]:
    if json_out is not None:
        return [json_out]
    if getattr(args, "display", "auto") == "none":
        return []
    ranks = {0} if getattr(args, "display", None) == "rank0" else console_ranks
    return [TextDisplay(ranks=ranks, colour=sys.stdout.isatty())]


def _start_detached(
    name: str, fn: Any, bound: inspect.BoundArguments, settings: Any, kind: str, source: Any
) -> int:
    """``run --detach``: the supervisor runs it; this command says how to follow it and ends."""
    try:
        handle = start_async(prepare_call(name, fn, bound, settings, kind=kind, source=source))
    except ConfigurationError as exc:
        print(f"air-magic run: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except LaunchError as exc:  # a Ray cluster that cannot be reached, say: nothing was started
        print(f"air-magic run: {exc}", file=sys.stderr)
        return 1
    run = handle.detached_id
    print(f"air-magic: detached run {run} started")
    where = ""
    if settings.cluster is not None and settings.cluster != "ray":  # not found by $RAY_ADDRESS otherwise
        where = f" --cluster {settings.cluster}"
    print(
        f"  follow it: air-magic attach{where} {run}   stop it: air-magic cancel{where} {run}   "
        f"logs: air-magic logs{where} {run}"
    )
    return 0


@verbs.handles("attach", "cli")
def _attach(args: argparse.Namespace) -> int:
    json_out = JsonLines() if args.json else None
    displays = _displays(args, json_out)
    found = anywhere.find(args.run, args.cluster)
    # A lost run too: what it wrote is replayed (its ranks' output), then why it has no result.
    handle = anywhere.attach(found, display="none", cluster=args.cluster, consumers=displays)
    previous = _stop_on_signals([])
    try:
        error = handle.exception()
    except KeyboardInterrupt:
        print(f"air-magic: stopped following; run {handle.detached_id} goes on", file=sys.stderr)
        return SIGNALLED + signal.SIGINT
    finally:
        _restore(previous)
    status = 0 if error is None else exit_status(error)
    values = None if error is not None else handle.result()
    _report(
        "function" if values and not isinstance(values[0], type(None)) else "attached",
        values,
        error,
        status,
        json_out,
    )
    return status


@verbs.handles("stack", "cli")
def _stack(args: argparse.Namespace) -> int:
    print(verbs.stack_of_run(args.run, args.rank, cluster=args.cluster))
    return 0


@verbs.handles("cancel", "cli")
def _cancel(args: argparse.Namespace) -> int:
    run = anywhere.find(args.run, args.cluster)
    if run.status == "lost":  # its supervisor died (and its ranks with it): nothing left to stop
        print(f"air-magic: run {run.id} was lost (its supervisor died, its ranks with it); nothing to cancel")
        return 0
    handle = anywhere.attach(run, display="none")
    if handle.done():
        print(f"air-magic: run {handle.detached_id} had already ended ({handle.status})")
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # why it has not ended is said here, in one line
        ended = handle.cancel()
    if ended:
        print(f"air-magic: run {handle.detached_id} cancelled; every rank is gone")
        return 0
    why = handle.why_not_ended()
    if why is not None:  # its ranks are stopped; only its record waits (a full disk)
        print(f"air-magic: run {handle.detached_id} cancelled: {why}")
        return 0
    print(f"air-magic: run {handle.detached_id} is still stopping", file=sys.stderr)
    return 1


@verbs.handles("ui", "cli")
def _ui(args: argparse.Namespace) -> int:
    from air_magic.tracking import ui as mlflow_ui
    from air_magic.tracking.store import current_uri

    if importlib.util.find_spec("mlflow") is None:
        raise UsageError("MLflow is not installed: pip install 'air_magic[mlflow]'")
    uri = args.store or current_uri()
    if args.stop:
        stopped = mlflow_ui.stop_ui(uri)
        print(f"air-magic: the MLflow UI over {uri} {'stopped' if stopped else 'was not running'}")
        return 0
    print(verbs.ui_page(uri, args.run))  # a run that is not there: ConfigurationError, one line
    return 0


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _run_notebook(path: str, argv: list[str], args: argparse.Namespace) -> int:
    """The notebook's code cells in order, in an IPython shell here, in the notebook's folder (as
    Jupyter and ``nbconvert --execute`` run them); the first failing cell ends it."""
    import json

    if not os.path.isfile(path):
        raise UsageError(f"no such notebook: {path}")
    if argv:
        raise UsageError(f"a notebook takes no arguments (got {' '.join(argv)}); its cells are what runs")
    if args.json:
        raise UsageError(
            "--json is for a script, -m module or module:function target; a notebook prints its cells"
        )
    given = settings_from_args(args)
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags}: a notebook's options go on its own %%distributed lines, not here")
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except ImportError:
        raise UsageError("a notebook target needs IPython: pip install 'air_magic[notebook]'") from None
    with open(path, encoding="utf-8") as f:
        cells = [c for c in json.load(f).get("cells", []) if c.get("cell_type") == "code"]
    folder = os.path.dirname(os.path.abspath(path))
    os.chdir(folder)  # relative paths in its cells mean what they mean in Jupyter
    sys.path.insert(0, folder)  # and its neighbour modules import, as in a kernel
    # Colours only for a terminal: a pipe or a log file gets tracebacks without escape codes.
    colour = sys.stdout.isatty() and sys.stderr.isatty()
    shell = InteractiveShell.instance(colors="linux" if colour else "nocolor")
    shell.run_line_magic("load_ext", "air_magic")
    stopped_by: list[int] = []
    previous = _stop_on_signals(stopped_by)
    try:
        for number, cell in enumerate(cells, 1):
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            result = shell.run_cell(source, store_history=True)
            error = result.error_before_exec or result.error_in_exec
            if error is not None:
                status = SIGNALLED + (stopped_by[0] if stopped_by else signal.SIGINT)
                if not isinstance(error, KeyboardInterrupt):
                    status = exit_status(error)
                print(f"air-magic: cell {number} of {path} failed; exit status {status}", file=sys.stderr)
                return status
        return _wait_for_background_runs(path, stopped_by)
    finally:
        _restore(previous)


def _wait_for_background_runs(path: str, stopped_by: list[int]) -> int:
    """After the last cell, the background runs the notebook started run to their end, as its
    reader expects (a kernel would have kept them going); the first failure sets the status."""
    from air_magic.calls import background

    status = 0
    for handle in background.running():
        print(f"air-magic: {path} ended; waiting for background run {handle.name}", file=sys.stderr)
        try:
            error = handle.exception()
        except KeyboardInterrupt:
            background.cancel_all()
            return SIGNALLED + (stopped_by[0] if stopped_by else signal.SIGINT)
        if error is not None and status == 0:
            status = exit_status(error)
            _print_error(error)
            print(f"air-magic: background run {handle.name} failed; exit status {status}", file=sys.stderr)
    return status


# SIGINT too, explicitly: a command started in the background by a script inherits SIGINT
# ignored, and Python keeps it so; `kill -INT` must still stop every rank. SIGHUP: the terminal
# went away.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop_on_signals(stopped_by: list[int]) -> dict[int, Any]:
    """Each stop signal raises a KeyboardInterrupt that names it (StopSignal): the call forwards the
    signal to every rank, waits its stop grace, then kills what is left. The old handlers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stopped_by.append(signum)
        raise StopSignal(signum)

    return {signum: signal.signal(signum, handler) for signum in _STOP_SIGNALS}


def _restore(previous: dict[int, Any]) -> None:
    for signum, old in previous.items():
        signal.signal(signum, old)


def exit_status(exc: BaseException) -> int:
    """The status a failed call gives the shell."""
    if isinstance(exc, DistributedTimeoutError):
        return TIMEOUT
    if isinstance(exc, RankFailedError) and exc.exit_code is not None:
        code = exc.exit_code
        return SIGNALLED - code if code < 0 else (code or 1)
    if isinstance(exc, targets.ScriptExit):  # the script's own sys.exit(N)
        return exc.exit_status
    if isinstance(exc, ConfigurationError):
        return USAGE_ERROR
    return 1


def _report(
    kind: str, values: list[Any] | None, error: BaseException | None, status: int, json_out: JsonLines | None
) -> None:
    info = history.last_run()
    if json_out is not None:
        json_out.emit(
            "result",
            exit_status=status,
            values=values,
            error=None if error is None else f"{type(error).__name__}: {error}",
            mlflow_run_id=info.mlflow_run_id if info else None,
            mlflow_url=info.tracking_url if info else None,
        )
    else:
        if values is not None and kind == "function":
            for rank, value in enumerate(values):
                print(f"rank {rank}: {value!r}")
        if error is not None and not isinstance(error, KeyboardInterrupt):
            _print_error(error)
    if info is not None and info.tracking:
        print(f"air-magic: {info.tracking}", file=sys.stderr)
    if error is not None:
        print(f"air-magic: exit status {status}", file=sys.stderr)


def _print_error(error: BaseException) -> None:
    """The rank's own traceback (not this process's frames, which say nothing), then the error;
    a request that cannot be met (no such GPUs, not placeable now) in one line."""
    if isinstance(error, ConfigurationError):
        print(f"air-magic run: {error}", file=sys.stderr)
        return
    if isinstance(error, targets.ScriptExit):  # sys.exit(N): the status says it (and the rank its message)
        return
    cause = error.__cause__
    if isinstance(cause, RemoteTraceback):
        print(str(cause), file=sys.stderr)
        said = traceback.format_exception_only(error)
        if cause.text.rstrip("\n").endswith(said[0].rstrip("\n")):  # the rank's own exception line
            said = said[1:]  # only the notes then: that line is the traceback's last
        if said:
            print("".join(said).rstrip("\n"), file=sys.stderr)
    else:
        # Not a rank's failure (one of this process's): its message, not air_magic's frames.
        print("".join(traceback.format_exception_only(error)).rstrip("\n"), file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover - python -m air_magic.cli
    raise SystemExit(main())
