"""The verbs both surfaces share: ``air-magic VERB`` and ``%distributed VERB`` mean the same.

One table (:data:`VERBS`) names every verb, its arguments and what it does, and
on which surface it exists; the command line's help and the line magic's help
and docstring are made from it, and both dispatch from it: each surface
registers its function for a verb with :func:`handles` and finds it with
:func:`handler` (``cli.py``, ``notebook/magics.py``; they import this module,
never the reverse, so the table is filled as each surface is imported). Each
verb's arguments are specified once, in its row (:class:`Arg`, an argument on
one surface or both), and both surfaces parse a verb's words with that spec
(:func:`parse`) before its handler runs: a bad or extra word is refused
(:class:`VerbUsageError`, with the verb's usage) and nothing runs. The verbs
that read what is on disk are written once here: :func:`runs` (the recent
calls, detached runs included) and :func:`logs` (a call's log folder, or a
rank's log). ``attach`` and ``cancel`` are ``calls/detached.py``'s on both.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeVar

from air_magic import paths
from air_magic.calls import anywhere, detached, history, ray_jobs
from air_magic.errors import ConfigurationError
from air_magic.protocol.events import Outcome

Surface = Literal["cli", "magic"]
BOTH: tuple[Surface, ...] = ("cli", "magic")
_Handler = TypeVar("_Handler", bound=Callable[..., Any])


@dataclass(frozen=True)
class Arg:
    """One argument of a verb: ``argparse``'s ``add_argument(*flags, **options)``, on the surfaces
    in ``on`` (an option of one surface only: ``--log-dir`` and ``--cluster`` of the command line,
    whose kernel has its own log folder and cluster)."""

    flags: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    on: tuple[Surface, ...] = BOTH


def arg(*flags: str, on: tuple[Surface, ...] = BOTH, **options: Any) -> Arg:
    return Arg(flags, options, on)


def split_logs_args(words: list[str]) -> tuple[str, int | None]:
    """``[RUN] [RANK]``: a bare number is a rank; RUN defaults to 'last'."""
    run, rank = split_run_rank(words, "logs")
    return run or "last", rank


def split_run_rank(words: list[str], verb: str) -> tuple[str | None, int | None]:
    """``[RUN] [RANK]`` of ``verb``: a bare number is a rank, anything else a run."""
    runs = [w for w in words if not w.isdigit()]
    ranks = [int(w) for w in words if w.isdigit()]
    if len(runs) > 1 or len(ranks) > 1:
        raise ConfigurationError(
            f"{verb} takes [RUN] [RANK] (a bare number is a RANK), got {' '.join(words)!r}"
        )
    return (runs[0] if runs else None), (ranks[0] if ranks else None)


def _given_run_rank(args: argparse.Namespace) -> list[str]:
    return [w for w in (args.run, args.rank) if w is not None]


def _logs_run_rank(args: argparse.Namespace) -> None:
    args.run, args.rank = split_logs_args(_given_run_rank(args))


def _stack_run_rank(args: argparse.Namespace) -> None:
    args.run, args.rank = split_run_rank(_given_run_rank(args), "stack")


def _session_options(args: argparse.Namespace) -> None:
    if args.options and args.action != "start":
        raise ConfigurationError(
            f"session {args.action} takes no options (got {' '.join(args.options)!r}); "
            "a session's options are given at session start"
        )


def _count(text: str) -> int:
    """A positive number (``runs -n 3``); argparse names the option when it is not one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


# The arguments more than one verb has. RUN and RANK come in either order (_logs_run_rank).
_LOG_DIR = arg(
    "--log-dir", help="where the calls' log folders are (default: where calls put them)", on=("cli",)
)
_CLUSTER = arg(
    "--cluster",
    metavar="ray[=ADDRESS]",
    help="also the runs on this Ray cluster (its dashboard, http://HEAD:8265); default: $RAY_ADDRESS",
    on=("cli",),
)
_RUN_RANK = (
    arg("run", nargs="?", metavar="RUN", help="a call's id (or the start of it)"),
    arg("rank", nargs="?", metavar="RANK", help="one rank (a bare number is a RANK)"),
)


@dataclass(frozen=True)
class Verb:
    name: str
    args: str  # the usage the help tables show (the magic's: tests/unit/test_verb_arguments.py)
    does: str
    magic: bool = True  # a ``%distributed`` verb
    cli: bool = True  # an ``air-magic`` command
    magic_aliases: tuple[str, ...] = ()  # earlier names ``%distributed`` still takes (existing notebooks)
    # Its arguments, parsed by parse() before its handler runs; None: its handler parses its words
    # itself (``run``: a TARGET and the settings schema's options, cli.py).
    arguments: tuple[Arg, ...] | None = ()
    check: Callable[[argparse.Namespace], None] | None = None  # after parsing; ConfigurationError: refused
    more: str = ""  # what ``air-magic VERB --help`` says after ``does``

    def on(self, surface: Surface) -> bool:
        return self.magic if surface == "magic" else self.cli


VERBS = (
    Verb(
        "run",
        "[options] TARGET [ARGS]",
        "TARGET on every rank: script.py, -m module, module:function, notebook.ipynb",
        magic=False,
        arguments=None,
    ),
    Verb(
        "status", "", "the last run of this kernel: outcome, time, each rank's state, log folder", cli=False
    ),
    Verb(
        "runs",
        "[-n N]",
        "the recent calls, newest first: outcome, ranks, time, log folder (detached runs too)",
        arguments=(_LOG_DIR, arg("-n", type=_count, default=20, help="how many (default: 20)"), _CLUSTER),
    ),
    Verb(
        "logs",
        "[RUN] [RANK]",
        "a call's log folder, or one rank's log (RUN: an id, or last: the default)",
        arguments=(_LOG_DIR, *_RUN_RANK, _CLUSTER),
        check=_logs_run_rank,
    ),
    Verb(
        "stack",
        "[RUN] [RANK]",
        "every thread's stack in each rank of a run going on (default: the newest; a detached run by "
        "its id, here or on a Ray cluster)",
        arguments=(*_RUN_RANK, _CLUSTER),
        check=_stack_run_rank,
        more="RUN: a detached run's id (or the start of it).",
    ),
    Verb(
        "attach",
        "[RUN]",
        "follow a detached run (default: the newest running): its output so far, then live",
        arguments=(
            arg("run", nargs="?", metavar="RUN", help="its id (or the start of it)"),
            arg("--json", action="store_true", help="one JSON object per event on stdout", on=("cli",)),
            _CLUSTER,
        ),
        more="The exit status says how it ended. Ctrl-C stops following; the run goes on.",
    ),
    Verb(
        "cancel",
        "[RUN]",
        "stop a run (every rank): a detached run by its id; in a kernel, RUN defaults to its newest "
        "run going on",
        arguments=(
            arg("run", metavar="RUN", help="its id (or the start of it)", on=("cli",)),
            arg("run", nargs="?", metavar="RUN", help="its id (or the start of it)", on=("magic",)),
            _CLUSTER,
        ),
    ),
    Verb(
        "ui",
        "[--run RUN_ID]",
        "the MLflow UI over the store: the one server your kernels share, started if needed",
        magic_aliases=("mlflow-ui",),  # its first name
        arguments=(
            arg(
                "--store",
                help="the tracking URI (default: MLFLOW_TRACKING_URI, else the embedded store)",
                on=("cli",),
            ),
            arg("--run", metavar="RUN_ID", help="this MLflow run's page rather than the UI's"),
            arg("--stop", action="store_true", help="stop the store's UI server", on=("cli",)),
        ),
        more="It listens on 127.0.0.1 and stops after a day without a call. Prints its address.",
    ),
    Verb("settings", "", "what this machine has, where logs go", cli=False),
    Verb(
        "restart", "", "rebuild the warm starter (it also rebuilds itself after package changes)", cli=False
    ),
    Verb(
        "session",
        "start [options] | status | restart | stop",
        "keep ranks up between cells (SPEC §15)",
        cli=False,
        arguments=(
            arg(
                "action",
                nargs="?",
                choices=("start", "status", "restart", "stop"),
                default="status",
                metavar="start|status|restart|stop",
            ),
            # start's: the options of %%distributed, parsed by its own parser (notebook/magics.py)
            arg("options", nargs=argparse.REMAINDER),
        ),
        check=_session_options,
    ),
    Verb("help", "", "this list", cli=False),
)


VERB = {v.name: v for v in VERBS}
_MAGIC_ALIAS = {alias: v.name for v in VERBS for alias in v.magic_aliases}

# Each surface's function for each of its verbs, filled by @handles as cli.py and magics.py are
# imported. A handler takes what parse() made of the words after the verb (an argparse.Namespace;
# ``run``'s, the words themselves) and returns the command's exit status, or the magic's value.
_HANDLERS: dict[Surface, dict[str, Callable[..., Any]]] = {"cli": {}, "magic": {}}


class VerbUsageError(ConfigurationError):
    """Words a verb's spec refuses (a bad value, an unknown option, one word too many); nothing ran.
    ``prog``: the verb as typed on its surface (``%distributed runs``), ``usage``: its usage line."""

    def __init__(self, message: str, *, prog: str = "", usage: str = "") -> None:
        super().__init__(message)
        self.prog = prog
        self.usage = usage


class _VerbParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise VerbUsageError(message, prog=self.prog, usage=self.format_usage().strip())


def _canonical(command: str, surface: Surface) -> str:
    return _MAGIC_ALIAS.get(command, command) if surface == "magic" else command


def verb_parser(name: str, surface: Surface) -> argparse.ArgumentParser:
    """The parser of verb ``name``'s arguments on ``surface``, made from its row of the table; its
    errors raise :class:`VerbUsageError`. The command line's has ``-h/--help``; the magic's does
    not (``%distributed help`` is the magic's help)."""
    verb = VERB[_canonical(name, surface)]
    if verb.arguments is None or not verb.on(surface):
        raise ValueError(f"the verb table (air_magic/verbs.py) gives no {surface} parser of {name!r}")
    prefix = "%distributed" if surface == "magic" else "air-magic"
    description = f"{verb.does[0].upper()}{verb.does[1:]}.{' ' + verb.more if verb.more else ''}"
    parser = _VerbParser(prog=f"{prefix} {verb.name}", description=description, add_help=surface == "cli")
    for argument in verb.arguments:
        if surface in argument.on:
            parser.add_argument(*argument.flags, **argument.options)
    return parser


def parse(name: str, surface: Surface, words: list[str]) -> argparse.Namespace | list[str]:
    """Verb ``name``'s ``words`` (what follows it on ``surface``), parsed by its spec: what its
    handler takes. Raises :class:`VerbUsageError` for words the spec refuses; a verb whose handler
    parses its own words (``arguments=None``: ``run``) gets them as they are."""
    verb = VERB[_canonical(name, surface)]
    if verb.arguments is None:
        return words
    parser = verb_parser(name, surface)
    args = parser.parse_args(words)
    if verb.check is not None:
        try:
            verb.check(args)
        except ConfigurationError as exc:
            parser.error(str(exc))
    return args


def handles(name: str, surface: Surface) -> Callable[[_Handler], _Handler]:
    """Registers the decorated function as ``surface``'s handler of verb ``name``; a verb the
    table does not give that surface is refused at import, so the table stays the one list."""
    verb = VERB.get(name)
    if verb is None or not verb.on(surface):
        raise ValueError(f"the verb table (air_magic/verbs.py) has no {surface} verb {name!r}")

    def register(fn: _Handler) -> _Handler:
        _HANDLERS[surface][name] = fn
        return fn

    return register


def handler(command: str, surface: Surface) -> Callable[..., Any] | None:
    """``surface``'s handler of ``command`` (on the magic, an earlier name of a verb is that verb);
    None for a command that is not one of its verbs."""
    return _HANDLERS[surface].get(_canonical(command, surface))


def handlers(surface: Surface) -> dict[str, Callable[..., Any]]:
    """The verbs ``surface`` has registered a handler for, and their handlers."""
    return dict(_HANDLERS[surface])


def help_text(surface: Surface) -> str:
    """The verbs of ``surface``, one line each, as its help shows them."""
    prefix = "%distributed" if surface == "magic" else "air-magic"
    shown = [v for v in VERBS if v.on(surface)]
    heads = [f"{prefix} {v.name} {v.args}".rstrip() for v in shown]
    width = max(len(h) for h in heads)
    lines = [f"{head:<{width}}  {v.does}" for head, v in zip(heads, shown, strict=True)]
    if surface == "magic":
        cell = "%%distributed [options]"
        lines.append(f"{cell:<{width}}  run the cell on every rank (%%distributed? lists the options)")
    return "\n".join(lines)


def names(surface: Surface) -> list[str]:
    return [v.name for v in VERBS if v.on(surface)]


def runs(log_root: str | None = None, n: int = 20, cluster: str | None = None) -> list[str]:
    """The recent calls, newest first, a line each; and, when the folder is the default one, every
    detached run of this user on this machine not among them (not started yet, lost, or with a log
    folder elsewhere); with ``cluster`` (a Ray cluster's address), its detached runs too."""
    summaries = history.read_summaries(log_root or paths.default_log_root())
    listed = {s["run_id"] for s in summaries}
    supervised = {run.id: run for run in detached.runs()}
    if cluster is not None:
        supervised.update({run.id: run for run in ray_jobs.runs(cluster)})
    rows: list[tuple[str, str]] = []  # (run id, line): ids begin with the time, so they sort by age
    for run in supervised.values():  # a detached run whose ranks have not started has no log folder yet
        if log_root is None and run.id not in listed:
            where = (
                "(detached)"
                if run.pid is not None or not run.folder.startswith("ray job")
                else f"({run.folder})"
            )
            line = f"{run.id}  {run.status:<11} {run.world_size!s:>3} rank(s) {'':>9}  {run.name}  {where}"
            rows.append((run.id, line))
    for summary in summaries:
        said = supervised[summary["run_id"]].status if summary["run_id"] in supervised else None
        if said is not None and said != Outcome.UNKNOWN:  # its supervisor knows best: 'cancelled', 'lost'
            summary["outcome"] = said
        took = summary.get("elapsed")
        took_text = "" if took is None else f"{took:.1f} s"
        outcome, ranks = summary.get("outcome", "?"), summary.get("world_size", "?")
        line = (
            f"{summary['run_id']}  {outcome:<11} {ranks!s:>3} rank(s) {took_text:>9}  "
            f"{summary.get('name', '?')}  {summary.get('log_dir', '')}"
        )
        rows.append((summary["run_id"], line))
    return [line for _, line in sorted(rows, reverse=True)[:n]]


def ui_page(uri: str, run: str | None = None) -> str:
    """What ``ui [--run RUN_ID]`` opens: the address of the MLflow UI over the store ``uri``
    (started if needed), or of MLflow run ``run``'s page there."""
    from air_magic.tracking import ui as mlflow_ui

    if run is None:
        return mlflow_ui.ensure_ui(uri)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:  # first: a run that is not there starts no server
        experiment_id = MlflowClient(tracking_uri=uri).get_run(run).info.experiment_id
    except MlflowException as exc:
        raise ConfigurationError(f"no MLflow run {run!r} in {uri}: {str(exc).splitlines()[0]}") from None
    return f"{mlflow_ui.ensure_ui(uri)}/#/experiments/{experiment_id}/runs/{run}"


def stack(handle: Any, rank: int | None = None) -> str:
    """What ``stack [RUN] [RANK]`` shows of the run behind ``handle`` (a RunHandle): every running
    rank's threads (or rank ``rank``'s), the user's frames first."""
    from air_magic.calls.background import StackDump

    if rank is not None and not 0 <= rank < handle.world_size:
        raise ConfigurationError(f"rank {rank} is not in {handle.name} (ranks 0 to {handle.world_size - 1})")
    if handle.status == "starting":
        return starting_line(handle)
    if handle.done():
        return f"{handle.name} has ended ({handle.status}): no stack to take"
    dump = handle.stacks()
    if rank is not None:
        dump = StackDump({r: t for r, t in dump.items() if r == rank})
    lines = [f"{handle.name}, {handle.status}:", str(dump)]
    if handle.log_dir and os.path.isdir(handle.log_dir):  # a run of this machine: the full dumps are kept
        lines.append(f"(every frame and thread: {os.path.join(handle.log_dir, paths.STACKS_FILE)})")
    return "\n".join(lines)


def starting_line(handle: Any) -> str:
    """What a verb says of a run still starting (no log folder, no ranks yet)."""
    return (
        f"air_magic: {handle.name} is starting in the background (its MLflow run and ranks are on "
        "their way); ask again in a moment"
    )


def stack_of_run(run: str | None, rank: int | None = None, cluster: str | None = None) -> str:
    """``stack [RUN] [RANK]`` of a detached run (default: the newest running), here or on the
    cluster: followed just long enough to take them (the run goes on; nothing stays followed)."""
    handle = anywhere.attach(run, display="none", cluster=cluster)
    try:
        return stack(handle, rank)
    finally:
        detached.stop_following(handle)


def logs(
    run: str,
    rank: int | None,
    log_root: str | None = None,
    last: Any = None,
    tail: int | None = None,
    cluster: str | None = None,
) -> str:
    """What ``logs RUN [RANK]`` shows: the call's folder and its files, or the rank's log (its last
    ``tail`` lines; the whole of it when None). ``last``: this kernel's last call (history.RunInfo),
    what 'last' means in a kernel; elsewhere it is the newest call in the log folder."""
    if run == "last" and last is not None:
        log_dir, world = last.log_dir, last.world_size
    else:
        summaries = history.read_summaries(log_root or paths.default_log_root())
        found = summaries[:1] if run == "last" else [s for s in summaries if s["run_id"] == run]
        if not found and cluster is not None and run != "last":
            return ray_jobs.rank_log(run, rank, cluster)  # a run on the Ray cluster: its node's logs
        if not found:
            raise ConfigurationError(f"no call {run!r} (runs lists them)")
        log_dir, world = found[0]["log_dir"], found[0].get("world_size")
    if rank is None:
        try:
            files = sorted(os.listdir(log_dir))
            sizes = [f"  {name}  {os.path.getsize(os.path.join(log_dir, name))} bytes" for name in files]
        except OSError as exc:  # pruned, or removed by hand
            raise ConfigurationError(f"{log_dir}: {exc.strerror or exc}") from None
        return "\n".join([log_dir, *sizes])
    path = paths.rank_log(log_dir, rank)
    if not os.path.exists(path):
        ranks = f" (ranks 0 to {world - 1})" if isinstance(world, int) else ""
        raise ConfigurationError(f"rank {rank} is not in call {os.path.basename(log_dir)}{ranks}")
    with open(path, errors="replace") as f:
        text = f.read()
    if tail is None:
        return text
    return "\n".join(text.splitlines()[-tail:]) + f"\n(full log: {path})"
