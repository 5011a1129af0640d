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
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from air_magic import paths, verbs
from air_magic.calls import anywhere, background, detached, history, persistent, ray_jobs
from air_magic.calls import call as session
from air_magic.errors import ConfigurationError
from air_magic.launch.accelerators import describe, detect_gpus
from air_magic.launch.settings import LaunchSettings, argument_specs, make_settings, settings_from_args
from air_magic.notebook import namespace
from air_magic.notebook.cell_analysis import names_assigned, names_deleted, names_read, star_imports
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
        namespace.refuse_magics(cell, source)
        filename = namespace.register_source(shell, source, number)
        tree = ast.parse(source, filename)  # a SyntaxError is shown as usual, before launch
        error = namespace.compile_as_the_rank_will(source, filename)
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
        values, modules, skipped = namespace.capture(shell, wanted, pushed)
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
            return namespace.bring_back(
                shell,
                outcomes,
                namespace.ends_with_expression(tree),
                imported=set(namespace.imported(tree)),
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
        """(Set below from the verb table, air_magic/verbs.py.)"""
        words = line.split(None, 1)
        command = words[0] if words else "status"
        handler = verbs.handler(command, "magic")
        if handler is None:
            raise UsageError(f"%distributed: unknown command {command!r}.\n{_HELP}")
        # The rest of the line, split as a shell would (session start's quoted option values),
        # then parsed by the verb's spec (verbs.py), as air-magic parses it: a bad or extra word
        # is one UsageError naming the verb and its usage, and nothing runs.
        try:
            args = verbs.parse(command, "magic", arg_split(words[1] if len(words) > 1 else "", posix=True))
        except verbs.VerbUsageError as exc:
            raise UsageError(f"{exc.prog}: {exc}\n{exc.usage}") from None
        return handler(args)


# The line magic's verbs (verbs.py's table): each takes its words as the verb's spec parsed them
# (an argparse.Namespace) and returns the magic's value.


@verbs.handles("settings", "magic")
def _show_settings(args: argparse.Namespace) -> None:
    gpus = detect_gpus()
    print(f"accelerators: {describe(gpus)}")
    print(f"log folder: {paths.default_log_root()}")


@verbs.handles("restart", "magic")
def _restart(args: argparse.Namespace) -> None:
    session.restart_warm_start()
    print("air_magic: the warm starter was stopped; the next call starts a fresh one")


@verbs.handles("runs", "magic")
def _runs(args: argparse.Namespace) -> None:
    print(
        "\n".join(verbs.runs(n=args.n, cluster=ray_jobs.cluster_address()))
        or "air_magic: no call yet in the log folder"
    )


@verbs.handles("help", "magic")
def _help(args: argparse.Namespace) -> None:
    print(_HELP)


@verbs.handles("session", "magic")
def _session(given: argparse.Namespace) -> Any:
    """%distributed session start [options] | status | restart | stop"""
    action = given.action
    live = persistent.active()
    if action == "start":  # its options: the cell's (the schema's), by the cell magic's parser
        args = DistributedMagics.distributed.parser.parse_args(given.options)
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
        print(shown.status() if shown is not None else "air_magic: no session (%distributed session start)")
        return None
    if action in ("stop", "restart"):
        if live is None:
            last = persistent.last()
            if action == "stop" or last is None:
                print("air_magic: no session is running")
                return None
            return last.restart()  # the last session, ended: in place, with its settings
        if action == "stop":
            live.stop()
            return None
        return live.restart()
    raise AssertionError(f"session {action!r}: not one of the spec's choices (verbs.py)")


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


_HELP = verbs.help_text("magic")
setattr(DistributedMagics.distributed_line, "__doc__", "%distributed VERB, one of:\n\n" + _HELP)  # noqa: B010


def _settings(args: argparse.Namespace) -> LaunchSettings:
    """The cell's settings from the options given; each value was already checked by argparse."""
    try:
        return make_settings(**settings_from_args(args))
    except ConfigurationError as exc:  # a check across settings, should one appear
        raise UsageError(str(exc)) from None


@verbs.handles("ui", "magic")
def _mlflow_ui(args: argparse.Namespace) -> Any:
    from air_magic.tracking.mlflow_import import import_mlflow
    from air_magic.tracking.store import current_uri

    # Imported on a helper thread: a Ctrl-C here must not leave a half-imported mlflow behind.
    if import_mlflow() is None:
        raise UsageError("MLflow is not installed: pip install 'air_magic[mlflow]'")

    uri = current_uri()
    try:
        page = verbs.ui_page(uri, args.run)
    except ConfigurationError as exc:  # no such MLflow run
        raise UsageError(f"%distributed ui: {exc}") from None
    from IPython.display import HTML, display

    title = "MLflow UI" if args.run is None else f"MLflow run {args.run}"
    display(HTML(f'<a href="{page}" target="_blank">{title}</a> on {page} (store {uri})'))
    print(f"{title}: {page}")
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


@verbs.handles("stack", "magic")
def _stack(args: argparse.Namespace) -> Any:
    run, rank = args.run, args.rank
    try:
        print(verbs.stack_of_run(run, rank) if run is not None else verbs.stack(_newest_background(), rank))
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None
    return None


@verbs.handles("attach", "magic")
def _attach(args: argparse.Namespace) -> Any:
    try:
        return anywhere.attach(args.run)
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None


@verbs.handles("cancel", "magic")
def _cancel(args: argparse.Namespace) -> None:
    """The newest run this kernel started or follows; another one only when named (RUN)."""
    if args.run is not None:
        try:
            handle = anywhere.attach(args.run, display="none")
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
    return verbs.starting_line(max(starting, key=lambda h: h.started))


@verbs.handles("status", "magic")
def _status(args: argparse.Namespace) -> None:
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
        root = " (the root cause)" if rank == info.failed_rank else ""
        print(f"  rank {rank}: {state}" + ("" if code is None else f" (exit status {code})") + root)
    if info.error:
        print(f"  error: {info.error.splitlines()[0]}")
    if info.tracking:
        print(f"  {info.tracking}")


@verbs.handles("logs", "magic")
def _logs(args: argparse.Namespace) -> None:
    """This kernel's last call (or RUN): its log folder, or the end of one rank's log."""
    starting = _starting()
    if starting is not None:  # this kernel's newest run has no log folder yet
        print(starting)
        return
    run, rank = args.run, args.rank
    try:
        last = history.last_run()
        if run == "last" and last is None:
            print("air_magic: no run yet in this kernel (%distributed logs RUN shows another's)")
            return
        print(verbs.logs(run, rank, last=last, tail=50, cluster=ray_jobs.cluster_address()))
    except ConfigurationError as exc:
        raise UsageError(f"%distributed logs: {exc}") from None


def load(shell: Any) -> None:
    shell.register_magics(DistributedMagics)


def unload(shell: Any) -> None:
    manager = shell.magics_manager
    manager.magics["cell"].pop("distributed", None)
    manager.magics["line"].pop("distributed", None)
    manager.registry.pop("DistributedMagics", None)
