"""The IPython extension: ``%%distributed`` (run a cell on every rank) and ``%distributed``.

Loaded with ``%load_ext air_magic`` (see ``load_ipython_extension`` in the
package). The cell magic turns the cell into a call of
:func:`air_magic.worker.cell_runner.run_cell` and launches it like the decorator does:

1. IPython's own transforms make the cell Python; line magics and shell
   escapes cannot run in a rank, so they are refused before launch, by line;
2. the cell is compiled as the rank will compile it
   (:func:`air_magic.worker.cell_runner.compile_cell`): a top-level ``return``,
   ``yield``, ``await`` or ``nonlocal`` is a SyntaxError here, nothing launched;
3. :mod:`air_magic.notebook.cell_analysis` finds the names the cell reads, updates or
   deletes; those the notebook defines are sent (modules are re-imported by
   name in the rank); one that cannot be pickled fails before launch, named;
4. after success, rank 0's versions come back: the names the cell assigned,
   the sent values it changed in place, the names its ``from m import *``
   bound; names it deleted are deleted here. The cell's output is the list of
   every rank's value of its last expression.

Options: every launch setting, generated from the schema in
:mod:`air_magic.launch.settings` and spelled like the decorator's keywords
(``-n/--num-accelerators``, ``--timeout SECONDS|none``, ``--env KEY=VALUE``
repeated, ``--tracking/--no-tracking``, ``--warm-start/--no-warm-start``...),
plus the magic's own ``--push``, ``--pull`` and ``--no-pull``. Decision:
``--cold`` stays, documented and without a warning, as an alias of
``--no-warm-start``, because existing notebooks use it and it costs one option.
It belongs to the magic, not to the schema, so the command line (issue 17)
does not start with two spellings of one setting.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import inspect
import linecache
import types
from collections.abc import Callable
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from air_magic import paths
from air_magic.errors import ConfigurationError, PayloadError
from air_magic.launch.accelerators import describe, detect_gpus
from air_magic.launch.settings import LaunchSettings, argument_specs, make_settings, settings_from_args
from air_magic.notebook.cell_analysis import names_assigned, names_deleted, names_read, star_imports
from air_magic.protocol import serialization
from air_magic.session import background, detached, history, persistent
from air_magic.session import call as session
from air_magic.worker import cell_runner

_F = TypeVar("_F", bound=Callable[..., Any])


def _setting_options(func: _F) -> _F:
    """One ``@argument`` per setting of the schema, listed in schema order by ``%%distributed?``."""
    # Decorators apply bottom-up and IPython lists options top-down: apply them reversed.
    for flags, keywords in reversed(argument_specs()):
        func = argument(*flags, **keywords)(func)
    return func


@magics_class
class DistributedMagics(Magics):
    @magic_arguments()
    @_setting_options
    @argument(
        "--cold",
        dest="warm_start",
        action="store_false",
        default=argparse.SUPPRESS,
        help="the same as --no-warm-start (kept for existing notebooks)",
    )
    @argument("--push", default="", help="comma-separated names to send besides those detected")
    @argument("--pull", default=None, help="comma-separated names to bring back from rank 0")
    @argument("--no-pull", action="store_true", help="bring nothing back")
    @argument(
        "--background",
        action="store_true",
        help="return a handle at once and keep the notebook free while the ranks run; "
        "handle.result() waits, then brings the names back",
    )
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on every GPU (or CPU rank); bring rank 0's new and changed names back.

        The cell's output is the list of every rank's value of its last expression.
        After success, from rank 0: the names the cell assigns (``x = ...``,
        ``x += 1``, ``def``, ``import``), those its ``from m import *`` binds, and
        every sent value whose data the cell changed in place (``history.append(2)``).
        Changed means its pickle differs from the one it arrived with (functions
        and classes count as themselves, not their code): a value the cell only
        reads stays the notebook's own object. A name the cell deletes at its top
        level (``del x``) is deleted in the notebook. ``--pull`` brings back
        exactly the names given, ``--no-pull`` nothing.
        """
        # Split as a shell would: --run-name "my run" is one value, without its quotes (IPython's own
        # parse_argstring splits the non-POSIX way and keeps them).
        args = self.distributed.parser.parse_args(arg_split(line, posix=True))
        settings = _settings(args)
        shell = self.shell
        assert shell is not None
        # IPython counts the cell before running it: the cell's own number is one less.
        number = max(shell.execution_count - 1, 0)
        source = shell.transform_cell(cell)
        _refuse_magics(cell, source)
        filename = _register_source(shell, source, number)
        tree = ast.parse(source, filename)  # a SyntaxError is shown as usual, before launch
        error = _compile_as_the_rank_will(source, filename)
        if error is not None:
            raise error  # from here: IPython lists every frame a SyntaxError in a magic went through

        live = persistent.for_cell()  # a session that ended since its last cell raises here
        if live is not None:
            _check_session_options(live, args)
        pushed = [n.strip() for n in args.push.split(",") if n.strip()]
        wanted = names_read(tree) + pushed
        if live is not None:  # the ranks' own objects win over the notebook's copies (docs/session.md)
            ns = shell.user_ns
            wanted = [n for n in wanted if n in pushed or not (n in ns and live.held_by_ranks(n, ns[n]))]
        values, modules, skipped = _capture(shell, wanted, pushed)
        if skipped:
            print(f"air_magic: not sent (IPython's own): {', '.join(skipped)}")
        watch: list[str] = []
        stars: list[str] = []
        if args.no_pull:
            pull: list[str] = []
        elif args.pull is not None:
            pull = [n.strip() for n in args.pull.split(",") if n.strip()]
        else:
            pull = [n for n in names_assigned(tree) if not n.startswith("_")]
            watch = [n for n in values if n not in pull and not n.startswith("_")]
            stars = star_imports(tree)

        bound = inspect.signature(cell_runner.run_cell).bind(
            source, filename, values, modules, pull, watch=watch, star_modules=stars
        )
        name = f"cell [{number}]"
        deleted = set(names_deleted(tree))

        def bring_back(outcomes: list[cell_runner.CellOutcome]) -> Any:
            return _bring_back(
                shell,
                outcomes,
                _ends_with_expression(tree),
                imported=set(_imported(tree)),
                deleted=deleted,
                session=live,
                asked=pull if args.pull is not None else [],
            )

        if live is not None:
            given = settings_from_args(args)
            result = live.run_call(
                name,
                cell_runner.run_cell,
                bound,
                kind="cell",
                source=cell,
                timeout=given.get("timeout", "session"),
                display=given.get("display"),
            )
            return bring_back(result.unwrap())

        if args.background:
            prepared = session.prepare_call(
                name, cell_runner.run_cell, bound, settings, kind="cell", source=cell, background=True
            )
            # The names come back when handle.result() is called, on the notebook's own thread:
            # never into the namespace of whatever cell happens to run when the ranks finish.
            return session.start_async(prepared, on_result=lambda result: bring_back(result.unwrap()))
        return bring_back(
            session.run_call(name, cell_runner.run_cell, bound, settings, kind="cell", source=cell).unwrap()
        )

    @line_magic("distributed")  # type: ignore[arg-type]
    def distributed_line(self, line: str) -> Any:
        """%distributed status | logs [RANK] | settings | help"""
        words = line.split()
        command = words[0] if words else "status"
        if command == "status":
            return _status()
        if command == "logs":
            return _logs(words[1:])
        if command == "settings":
            gpus = detect_gpus()
            print(f"accelerators: {describe(gpus)}")
            print(f"log folder: {paths.default_log_root()}")
            return None
        if command == "restart":
            session.restart_warm_start()
            print("air_magic: the warm starter was stopped; the next call starts a fresh one")
            return None
        if command == "runs":
            return _runs()
        if command == "attach":
            return _attach(words[1:])
        if command == "stack":
            return _stack(words[1:])
        if command == "cancel":
            return _cancel(words[1:])
        if command == "mlflow-ui":
            return _mlflow_ui()
        if command == "session":
            return self._session(line.split(None, 1)[1] if len(words) > 1 else "")
        if command == "help":
            print(_HELP)
            return None
        raise UsageError(f"%distributed: unknown command {command!r}.\n{_HELP}")

    def _session(self, rest: str) -> Any:
        """%distributed session start [options] | status | restart | stop"""
        words = arg_split(rest, posix=True)
        action = words[0] if words else "status"
        live = persistent.active()
        if action == "start":
            args = self.distributed.parser.parse_args(words[1:])
            for option in ("push", "pull"):
                if getattr(args, option, None):
                    raise UsageError(f"%distributed session start: --{option} is for a cell, not the session")
            if args.background or args.no_pull:
                raise UsageError("%distributed session start: --background/--no-pull are for a cell")
            try:
                return persistent.Session(_settings(args)).start()
            except ConfigurationError as exc:
                raise UsageError(str(exc)) from None
        if action == "status":
            shown = live or persistent.last()
            print(
                shown.status() if shown is not None else "air_magic: no session (%distributed session start)"
            )
            return None
        if action in ("stop", "restart"):
            if live is None:
                last = persistent.last()
                if action == "stop" or last is None:
                    print("air_magic: no session is running")
                    return None
                return persistent.Session(last.settings, last.name).start()
            if action == "stop":
                live.stop()
                return None
            return live.restart()
        raise UsageError(f"%distributed session: unknown command {action!r} (start, status, restart, stop)")


def _check_session_options(live: persistent.Session, args: argparse.Namespace) -> None:
    """A cell in a session may set its own timeout and display; the rest is the session's."""
    given = settings_from_args(args)
    if args.background:
        raise UsageError(
            "%%distributed --background does not run in a session; %distributed session stop first"
        )
    ranks = given.pop("num_accelerators", None)
    if ranks is not None and ranks != live.world_size:
        raise UsageError(
            f"this cell asks for {ranks} rank(s); session {live.id} has {live.world_size}. "
            "Drop -n, or %distributed session stop and start one with -n"
        )
    others = sorted(set(given) - {"timeout", "display"})
    if others:
        options = ", ".join("--" + name.replace("_", "-") for name in others)
        raise UsageError(
            f"{options}: set for the whole session at %distributed session start; "
            "a cell in a session may set --timeout and --display"
        )


_HELP = """%distributed status        the last run: outcome, time, each rank's state, log folder
%distributed logs [RANK]   where the last run's logs are, or the end of one rank's log
%distributed stack [RANK]  every thread's stack in each rank of the running background run
%distributed cancel [RUN]  stop this kernel's newest run going on (or the detached run RUN)
%distributed runs          this user's detached runs on this machine, from any kernel
%distributed attach [RUN]  re-open a detached run (default: the newest running): output so far, then live
%distributed settings      what this machine has, where logs go
%distributed restart       rebuild the warm starter (it also rebuilds itself after package changes)
%distributed session start [options]   keep ranks up between cells (-n, --timeout per cell...)
%distributed session status|restart|stop   what the session holds; a new one; its end
%distributed mlflow-ui     the MLflow UI over the local store (shared by your kernels; started if needed)
%%distributed [options]    run the cell on every rank (%%distributed? lists the options)"""


def _settings(args: argparse.Namespace) -> LaunchSettings:
    """The cell's settings from the options given; each value was already checked by argparse."""
    try:
        return make_settings(**settings_from_args(args))
    except ConfigurationError as exc:  # a check across settings, should one appear
        raise UsageError(str(exc)) from None


def _refuse_magics(cell: str, source: str) -> None:
    """Line magics and shell escapes need the notebook's shell, which a rank does not have."""
    if "get_ipython()" not in source or "get_ipython()" in cell:
        return
    raw = cell.splitlines()
    bad = [
        f"line {i}: {raw[i - 1].strip() if i - 1 < len(raw) else line.strip()}"
        for i, line in enumerate(source.splitlines(), 1)
        if "get_ipython()" in line
    ]
    raise UsageError(
        "%%distributed cannot run IPython magics or shell escapes inside the ranks ("
        + "; ".join(bad)
        + "). Run them in a cell of their own, or use subprocess/os in the cell."
    )


def _compile_as_the_rank_will(source: str, filename: str) -> SyntaxError | None:
    """The error every rank would hit on what only a function may hold (``return``, ``await``...)."""
    try:
        cell_runner.compile_cell(source, filename)
    except SyntaxError as exc:
        text = exc.text
        lines = source.splitlines()
        if text is None and exc.lineno is not None and 0 < exc.lineno <= len(lines):
            text = lines[exc.lineno - 1] + "\n"  # compiling a tree leaves it out; IPython shows it
        where = (filename, exc.lineno, exc.offset, text, exc.end_lineno, exc.end_offset)
        return SyntaxError(exc.msg, where)
    return None


def _register_source(shell: Any, source: str, number: int) -> str:
    """Name the cell like IPython does and put its lines in linecache, for tracebacks."""
    try:
        return str(shell.compile.cache(source, number))
    except Exception:  # noqa: BLE001 - older IPython: register by hand
        name = f"<distributed-cell-{number}>"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        return name


def _capture(
    shell: Any, names: list[str], pushed: list[str]
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Split the notebook's values for ``names`` into values to send and modules to re-import."""
    values: dict[str, Any] = {}
    modules: dict[str, str] = {}
    skipped: list[str] = []
    hidden = shell.user_ns_hidden
    for name in dict.fromkeys(names):
        if name not in shell.user_ns:
            if name in pushed:
                raise UsageError(f"--push {name}: no such name in the notebook")
            continue  # a builtin, or a NameError the rank will report
        value = shell.user_ns[name]
        if name in hidden and hidden[name] is value:
            if not hasattr(builtins, name):  # IPython's own open, exit...: the ranks have Python's
                skipped.append(name)
        elif isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        else:
            found = serialization.find_unpicklable(value, f"notebook variable {name!r}")
            if found is not None:
                where, error = found
                raise PayloadError(
                    f"cannot send {where} to the ranks: {error}. Create it inside the cell instead, "
                    "or keep it out of the cell."
                )
            values[name] = value
    return values, modules, skipped


def _ends_with_expression(tree: ast.Module) -> bool:
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr)


def _imported(tree: ast.Module) -> list[str]:
    return [
        alias.asname or alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]


def _bring_back(
    shell: Any,
    outcomes: list[cell_runner.CellOutcome],
    ends_with_expression: bool,
    imported: set[str],
    deleted: set[str],
    session: persistent.Session | None = None,
    asked: list[str] | None = None,
) -> Any:
    """Put rank 0's names into the notebook; return every rank's last value (None if all are None).

    ``asked``: the names of ``--pull``; one rank 0 does not have after the cell is said, not skipped.

    Imported names (star imports included) come back too (by reference) but
    are not listed: the line names the data the cell made or changed.
    """
    first = outcomes[0]
    loaded: dict[str, Any] = {}
    failed = dict(first.unpicklable)
    for name, data in first.names.items():
        try:
            loaded[name] = serialization.loads(data)
        except Exception as exc:  # noqa: BLE001
            failed[name] = f"could not be loaded here: {exc}"
    shell.user_ns.update(loaded)
    gone = _delete_what_the_cell_deleted(shell, first.missing, deleted)
    if session is not None:
        # Every name the cell bound in the ranks, with what the notebook has for it now: the copy that
        # came back, or (not brought back) the old value, which must not overwrite the ranks' own.
        bound = {*first.names, *first.unpicklable}
        session.note_held({n: shell.user_ns.get(n, persistent._ABSENT) for n in bound})
        session.forget(gone)
    hidden = imported | set(first.star_names)
    shown = [k for k, v in loaded.items() if k not in hidden and not isinstance(v, types.ModuleType)]
    said = [f"{k} (changed in place)" if k in first.changed else k for k in shown]
    parts = [f"brought back from rank 0: {', '.join(said)}"] if said else []
    if gone:
        parts.append(f"deleted: {', '.join(gone)}")
    if parts:
        print(f"air_magic: {'; '.join(parts)}")
    if failed:
        print("air_magic: not brought back: " + "; ".join(f"{k} ({v})" for k, v in failed.items()))
    unknown = [n for n in first.missing if n in (asked or []) and n not in gone]
    if unknown:
        print(f"air_magic: --pull {', '.join(unknown)}: rank 0 has no such name after the cell")
    info = history.last_run()
    if not ends_with_expression:
        return None
    values: list[Any] = []
    for rank, outcome in enumerate(outcomes):
        if outcome.value is None:
            print(f"air_magic: rank {rank}'s last value could not be sent back: {outcome.value_error}")
            values.append(None)
        else:
            values.append(serialization.loads(outcome.value))
    if info is not None:
        info.values = values
    # Like IPython, show nothing when there is nothing to show (a final print(), say).
    return None if all(v is None for v in values) else values


def _delete_what_the_cell_deleted(shell: Any, missing: list[str], deleted: set[str]) -> list[str]:
    """Names rank 0 ended without because the cell ran ``del`` on them (not a loop that never ran)."""
    gone = [n for n in missing if n in deleted and n in shell.user_ns]
    for name in gone:
        del shell.user_ns[name]
    return gone


def _mlflow_ui() -> Any:
    from air_magic.tracking import ui as mlflow_ui
    from air_magic.tracking.mlflow_import import import_mlflow
    from air_magic.tracking.store import current_uri

    # Imported on a helper thread: a Ctrl-C here must not leave a half-imported mlflow behind.
    if import_mlflow() is None:
        raise UsageError("MLflow is not installed: pip install 'air_magic[mlflow]'")

    uri = current_uri()
    base = mlflow_ui.ensure_ui(uri)
    from IPython.display import HTML, display

    display(HTML(f'<a href="{base}" target="_blank">MLflow UI</a> on {base} (store {uri})'))
    print(f"MLflow UI: {base}")
    return None


def _newest_background() -> background.RunHandle:
    """The newest run going on while this kernel is free: a background run of this kernel, a
    detached run it follows, else the newest detached run of this user on this machine."""
    runs = [*background.running(), *detached.followed()]
    if runs:
        return max(runs, key=lambda h: h.started)
    try:
        return detached.attach(None, display="none")
    except ConfigurationError:
        raise UsageError(
            "%distributed: no run is going on (start one with %%distributed --background, "
            "fn.distributed_async(...) or detach=True)"
        ) from None


def _stack(args: list[str]) -> Any:
    handle = _newest_background()
    if handle.status == "starting":
        print(_starting() or f"air_magic: {handle.name} is starting")
        return None
    dump = handle.stacks()
    if args:
        try:
            rank = int(args[0])
        except ValueError:
            raise UsageError("%distributed stack takes a rank number") from None
        if not 0 <= rank < handle.world_size:
            raise UsageError(f"rank {rank} is not in {handle.name} (ranks 0 to {handle.world_size - 1})")
        dump = background.StackDump({r: t for r, t in dump.items() if r == rank})
    print(f"{handle.name}, {handle.status}:")
    print(dump)
    if handle.log_dir:
        print(f"(every frame and thread: {handle.log_dir}/stacks.txt)")
    return None


def _runs() -> None:
    listed = detached.runs()
    if not listed:
        print("air_magic: no detached run on this machine (detach=True / --detach starts one)")
    for run in listed:
        print(run)


def _attach(args: list[str]) -> Any:
    try:
        return detached.attach(args[0] if args else None)
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None


def _cancel(args: list[str]) -> None:
    """The newest run this kernel started or follows; another one only when named (RUN)."""
    if args:
        try:
            handle = detached.attach(args[0], display="none")
        except ConfigurationError as exc:
            raise UsageError(str(exc)) from None
    else:
        mine = [*background.running(), *detached.followed()]
        if not mine:
            raise UsageError(
                "%distributed cancel: this kernel has no run going on; %distributed cancel RUN stops "
                "a detached run of another kernel (%distributed runs lists them)"
            )
        handle = max(mine, key=lambda h: h.started)
    if handle.done():
        print(f"air_magic: {handle.name} had already ended ({handle.status})")
        return
    ended = handle.cancel()
    print(f"air_magic: {handle.name} {'cancelled; every rank is gone' if ended else 'is still stopping'}")


def _starting() -> str | None:
    """A line for a background run of this kernel still starting (no log folder, no ranks yet)."""
    starting = [h for h in background.running() if h.status == "starting"]
    if not starting:
        return None
    handle = max(starting, key=lambda h: h.started)
    return (
        f"air_magic: {handle.name} is starting in the background (its MLflow run and ranks are on "
        "their way); ask again in a moment"
    )


def _status() -> None:
    info = history.last_run()
    starting = _starting()
    if starting is not None:
        print(starting)
    if info is None:
        if starting is None:
            print("air_magic: no run yet in this kernel")
        return
    took = "" if info.elapsed is None else f" in {info.elapsed:.1f} s"
    print(f"{info.name}: {info.outcome}{took}; {info.world_size} rank(s); logs: {info.log_dir}")
    for rank in range(info.world_size):
        state = info.rank_states.get(rank, "running")
        code = info.rank_exit_codes.get(rank)
        print(f"  rank {rank}: {state}" + ("" if code is None else f" (exit status {code})"))
    if info.error:
        print(f"  error: {info.error.splitlines()[0]}")
    if info.tracking:
        print(f"  {info.tracking}")


def _logs(args: list[str]) -> None:
    info = history.last_run()
    starting = _starting()
    if starting is not None:  # the newest run has no log folder yet
        print(starting)
        return
    if info is None:
        print("air_magic: no run yet in this kernel")
        return
    if not args:
        print(info.log_dir)
        return
    try:
        rank = int(args[0])
    except ValueError:
        raise UsageError("%distributed logs takes a rank number") from None
    if not 0 <= rank < info.world_size:
        raise UsageError(f"rank {rank} is not in the last run (ranks 0 to {info.world_size - 1})")
    with open(info.log_path(rank), errors="replace") as f:
        lines = f.read().splitlines()
    print("\n".join(lines[-50:]))
    print(f"(full log: {info.log_path(rank)})")


def load(shell: Any) -> None:
    shell.register_magics(DistributedMagics)


def unload(shell: Any) -> None:
    manager = shell.magics_manager
    manager.magics["cell"].pop("distributed", None)
    manager.magics["line"].pop("distributed", None)
    manager.registry.pop("DistributedMagics", None)
