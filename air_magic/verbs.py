"""The verbs both surfaces share: ``air-magic VERB`` and ``%distributed VERB`` mean the same.

One table (:data:`VERBS`) names every verb, its arguments and what it does, and
on which surface it exists; the command line's help and the line magic's help
and docstring are made from it, and both dispatch from it: each surface
registers its function for a verb with :func:`handles` and finds it with
:func:`handler` (``cli.py``, ``notebook/magics.py``; they import this module,
never the reverse, so the table is filled as each surface is imported). The verbs
that read what is on disk are written once here: :func:`runs` (the recent
calls, detached runs included) and :func:`logs` (a call's log folder, or a
rank's log). ``attach`` and ``cancel`` are ``calls/detached.py``'s on both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from air_magic import paths
from air_magic.calls import anywhere, detached, history, ray_jobs
from air_magic.errors import ConfigurationError
from air_magic.protocol.events import Outcome

Surface = Literal["cli", "magic"]
_Handler = TypeVar("_Handler", bound=Callable[..., Any])


@dataclass(frozen=True)
class Verb:
    name: str
    args: str
    does: str
    magic: bool = True  # a ``%distributed`` verb
    cli: bool = True  # an ``air-magic`` command
    magic_aliases: tuple[str, ...] = ()  # earlier names ``%distributed`` still takes (existing notebooks)

    def on(self, surface: Surface) -> bool:
        return self.magic if surface == "magic" else self.cli


VERBS = (
    Verb(
        "run",
        "[options] TARGET [ARGS]",
        "TARGET on every rank: script.py, -m module, module:function, notebook.ipynb",
        magic=False,
    ),
    Verb(
        "status", "", "the last run of this kernel: outcome, time, each rank's state, log folder", cli=False
    ),
    Verb(
        "runs",
        "[-n N]",
        "the recent calls, newest first: outcome, ranks, time, log folder (detached runs too)",
    ),
    Verb("logs", "[RUN] [RANK]", "a call's log folder, or one rank's log (RUN: an id, or last: the default)"),
    Verb(
        "stack",
        "[RUN] [RANK]",
        "every thread's stack in each rank of a run going on (default: the newest; a detached run by "
        "its id, here or on a Ray cluster)",
    ),
    Verb(
        "attach", "[RUN]", "follow a detached run (default: the newest running): its output so far, then live"
    ),
    Verb(
        "cancel",
        "[RUN]",
        "stop a run (every rank): a detached run by its id; in a kernel, RUN defaults to its newest "
        "run going on",
    ),
    Verb(
        "ui",
        "[--run RUN_ID]",
        "the MLflow UI over the store: the one server your kernels share, started if needed",
        magic_aliases=("mlflow-ui",),  # its first name
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
    ),
    Verb("help", "", "this list", cli=False),
)


VERB = {v.name: v for v in VERBS}
_MAGIC_ALIAS = {alias: v.name for v in VERBS for alias in v.magic_aliases}

# Each surface's function for each of its verbs, filled by @handles as cli.py and magics.py are
# imported. A command line handler takes the words after the verb and returns the exit status; a
# line magic handler takes the rest of the line as typed and returns the magic's value.
_HANDLERS: dict[Surface, dict[str, Callable[..., Any]]] = {"cli": {}, "magic": {}}


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
    if surface == "magic":
        command = _MAGIC_ALIAS.get(command, command)
    return _HANDLERS[surface].get(command)


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


def split_logs_args(words: list[str]) -> tuple[str, int | None]:
    """``[RUN] [RANK]``: a bare number is a rank; RUN defaults to 'last'."""
    run, rank = split_run_rank(words, "logs")
    return run or "last", rank


def split_run_rank(words: list[str], verb: str) -> tuple[str | None, int | None]:
    """``[RUN] [RANK]`` of ``verb``: a bare number is a rank, anything else a run."""
    runs = [w for w in words if not w.isdigit()]
    ranks = [int(w) for w in words if w.isdigit()]
    if len(runs) > 1 or len(ranks) > 1:
        raise ConfigurationError(f"{verb} takes [RUN] [RANK], got {' '.join(words)!r}")
    return (runs[0] if runs else None), (ranks[0] if ranks else None)


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
