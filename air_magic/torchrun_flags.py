"""torchrun's options on ``air-magic run`` (SPEC §17): a torchrun line works with the command renamed.

``torchrun --standalone --nproc-per-node=2 train.py --lr 0.1`` and ``air-magic run --standalone
--nproc-per-node=2 train.py --lr 0.1`` start the same ranks with the same variables. Every option
of torchrun (``python -m torch.distributed.run --help``, torch 2.13) is accepted, in its dash and
underscore spellings and, as torchrun reads them, from ``PET_<NAME>`` variables when the option
is not given (``PET_NPROC_PER_NODE=4``). Each one is one of:

- a setting of ours: ``--nproc-per-node`` (the ranks: a number, ``auto``, ``gpu``, ``cpu``), ``--log-dir``,
  ``--shutdown-timeout`` (the stop grace), ``--role`` (``ROLE_NAME``), ``--signals-to-handle``
  (``TORCHELASTIC_SIGNALS_TO_HANDLE``), ``--max-restarts``, ``--local-ranks-filter`` (the console
  only: the logs keep every rank), ``--no-python`` (TARGET is a program), ``-m``/``--module``;
- what air_magic always does, accepted without a word: ``--standalone``, ``--nnodes 1``,
  ``--node-rank 0``, ``--run-path``, ``--monitor-interval``;
- accepted with one line saying why it changes nothing here: the rendezvous options and
  ``--master-addr``/``--master-port`` (air_magic's store listens on a free loopback port, so two
  jobs never collide on 29500), ``-r``/``-t`` (every rank's output is in its log and on the
  console), ``--start-method``, and the rest of torchrun's tuning options;
- refused, with what to do instead, where it asks for more than this machine: ``--nnodes 2``
  without ``--cluster ray``, ``--node-rank 1``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

GROUP_TITLE = "torchrun's options (accepted as torchrun takes them; docs/torchrun.md)"

# What each of torchrun's options does here: a setting of ours (mapped in _apply), what air_magic
# always does, or nothing (with the words of the one line that says why).
_SETTINGS = (
    "nnodes", "nproc-per-node", "max-restarts", "role", "module", "no-python", "log-dir",
    "local-ranks-filter", "node-rank", "signals-to-handle", "shutdown-timeout", "virtual-local-rank",
)  # fmt: skip
_ALWAYS = ("standalone", "monitor-interval", "run-path")
_NO_EFFECT_BECAUSE = {
    "air_magic hosts the rendezvous store itself, on a free loopback port (two jobs never share 29500)": (
        "rdzv-backend", "rdzv-endpoint", "rdzv-conf", "master-addr", "master-port",
    ),
    "the call's own id names its rendezvous": ("rdzv-id",),
    "ranks start as fresh interpreters or as forks of the warm starter (--no-warm-start chooses)": (
        "start-method",
    ),
    "air_magic records its events in the call's log folder and MLflow run": ("event-log-handler",),
    "every rank's output goes to its own log file and to the console": (
        "redirects", "tee", "logs-specs", "duplicate-stdout-filters", "duplicate-stderr-filters",
    ),
    "the ranks of one machine talk over loopback": ("local-addr",),
    "air_magic does not bind ranks to NUMA nodes (numactl in the script does)": ("numa-binding",),
}  # fmt: skip
_WITHOUT_VALUE = frozenset({"standalone", "module", "no-python", "run-path", "virtual-local-rank"})
# name -> (takes a value, "setting" | "same" | why it has no effect here)
_FLAGS: dict[str, tuple[bool, str]] = {
    **{name: (name not in _WITHOUT_VALUE, "setting") for name in _SETTINGS},
    **{name: (name not in _WITHOUT_VALUE, "same") for name in _ALWAYS},
    **{name: (True, why) for why, names in _NO_EFFECT_BECAUSE.items() for name in names},
}
# air_magic's own setting for the same thing: given, it wins over the PET_ variable.
_OWN = {"nproc-per-node": "num_accelerators", "log-dir": "log_dir", "shutdown-timeout": "stop_grace"}
_SHORT = {"redirects": "-r", "tee": "-t"}  # torchrun's one-letter spellings (-m is TARGET's, cli.py)


def dest(name: str) -> str:
    return "torchrun_" + name.replace("-", "_")


def pet_variable(name: str) -> str:
    """The variable torchrun reads for an option not given (``PET_NPROC_PER_NODE``)."""
    return "PET_" + name.replace("-", "_").upper()


def add_to(parser: argparse.ArgumentParser) -> None:
    """torchrun's options, in a group of their own (``air-magic run --help`` lists them)."""
    group = parser.add_argument_group(GROUP_TITLE)
    for name, (takes_value, _) in _FLAGS.items():
        flags = [f"--{name}"]
        if "-" in name:
            flags.append(f"--{name.replace('-', '_')}")
        if name in _SHORT:
            flags.insert(0, _SHORT[name])
        if name == "module":
            flags = ["--module"]  # -m is split off with its module name before parsing (cli.py)
        if name == "log-dir":
            flags = ["--log_dir"]  # --log-dir is air_magic's own option: the same folder
        keywords: dict[str, Any] = {
            "dest": dest(name),
            "default": argparse.SUPPRESS,
            "help": argparse.SUPPRESS,
        }
        if not takes_value:
            keywords["action"] = "store_true"
        group.add_argument(*flags, **keywords)
    group.description = "torchrun's options: " + ", ".join(f"--{n}" for n in _FLAGS)


@dataclass
class TorchrunLine:
    """What a command line's torchrun options ask of the call."""

    settings: dict[str, Any] = field(default_factory=dict)  # make_settings keywords
    env: dict[str, str] = field(default_factory=dict)  # more variables for every rank
    notes: list[str] = field(default_factory=list)  # one line each: an option with no effect here
    max_restarts: int = 0
    console_ranks: set[int] | None = None  # --local-ranks-filter: the console shows only these
    program: bool = False  # --no-python: TARGET is a program, not a Python script
    module: bool = False  # --module: TARGET is a module name
    force_cpu: bool = False  # --nproc-per-node=cpu: CPU ranks even where GPUs are visible
    given: set[str] = field(default_factory=set)  # the torchrun options given (or their PET_ variables)
    nodes: int = 1  # --nnodes (its most): with --cluster ray, the ranks are nodes x nproc-per-node


def flag_from_env(name: str, environ: dict[str, str] | None = None) -> bool:
    """A flag of torchrun's set through its ``PET_`` variable (``PET_NO_PYTHON=1``)."""
    raw = (os.environ if environ is None else environ).get(pet_variable(name), "")
    return raw.strip().lower() not in ("0", "false", "no", "")


class TorchrunUsageError(ValueError):
    """An option asks for what air_magic cannot do here: the message says what to do instead."""


def read(
    args: argparse.Namespace, given: dict[str, Any], environ: dict[str, str] | None = None
) -> TorchrunLine:
    """The call's torchrun options: those on the line, else their ``PET_`` variables.

    ``given``: the settings already given with air_magic's own options (they win over a
    ``PET_`` variable, and an explicit ``-n`` with a different ``--nproc-per-node`` is an error)."""
    environ = dict(os.environ if environ is None else environ)
    line = TorchrunLine()
    values: dict[str, Any] = {}
    for name, (takes_value, _) in _FLAGS.items():
        if hasattr(args, dest(name)):
            values[name] = getattr(args, dest(name))
        elif environ.get(pet_variable(name), "") != "" and _OWN.get(name, "-") not in given:
            # A PET_ variable stands for an option not given; air_magic's own option, given, wins.
            raw = environ[pet_variable(name)]
            values[name] = raw if takes_value else flag_from_env(name, environ)
    if values.get("no-python") and values.get("module"):
        raise TorchrunUsageError("--no-python and --module: TARGET is either a program or a module")
    for name, value in values.items():
        what = _FLAGS[name][1]
        if what == "same" or (not _FLAGS[name][0] and not value):
            continue
        if what != "setting":
            spelled = f"--{name}" + (f"={value}" if _FLAGS[name][0] else "")
            line.notes.append(f"{spelled}: no effect here ({what})")
            continue
        _apply(name, value, line, given)
    line.given = {name for name, value in values.items() if _FLAGS[name][0] or value}
    if line.nodes > 1 and "num_accelerators" in line.settings:
        line.settings["num_accelerators"] *= line.nodes
    return line


def _apply(name: str, value: Any, line: TorchrunLine, given: dict[str, Any]) -> None:
    if name == "nproc-per-node":
        ranks = _nproc(str(value), line)
        if ranks is not None:
            if given.get("num_accelerators") not in (None, ranks):
                raise TorchrunUsageError(
                    f"-n {given['num_accelerators']} and --nproc-per-node={value} disagree"
                )
            line.settings["num_accelerators"] = ranks
    elif name == "nnodes":
        low, _, high = str(value).partition(":")
        most = _int(name, high or low)
        if most > 1 and not str(given.get("cluster") or "").startswith("ray"):
            raise TorchrunUsageError(
                f"--nnodes={value}: air-magic run starts every rank from this one machine; for more "
                "than one node add --cluster ray (the nodes of a Ray cluster), once, on any node"
            )
        line.nodes = most
    elif name == "node-rank":
        if _int(name, value) != 0:
            raise TorchrunUsageError(
                f"--node-rank={value}: air-magic run is run once, not once per node; with --cluster ray "
                "it starts the ranks of every node itself"
            )
    elif name == "max-restarts":
        line.max_restarts = _int(name, value)
        if line.max_restarts < 0:
            raise TorchrunUsageError(f"--max-restarts={value}: give 0 or more")
    elif name == "role":
        line.env["ROLE_NAME"] = str(value)
    elif name == "signals-to-handle":
        line.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = str(value)
    elif name == "shutdown-timeout":
        if "stop_grace" not in given:
            line.settings["stop_grace"] = float(_int(name, value))
    elif name == "virtual-local-rank":
        raise TorchrunUsageError(
            "--virtual-local-rank: not supported; every rank sees its node's GPUs and picks its own "
            "with LOCAL_RANK (torch.cuda.set_device(int(os.environ['LOCAL_RANK'])))"
        )
    elif name == "log-dir":
        if "log_dir" not in given:
            line.settings["log_dir"] = str(value)
    elif name == "local-ranks-filter":
        line.console_ranks = {_int(name, part) for part in str(value).split(",") if part.strip()}
    elif name == "no-python":
        line.program = True
    elif name == "module":
        line.module = True


def _nproc(value: str, line: TorchrunLine) -> int | None:
    """torchrun's ``--nproc-per-node``: a number, ``auto`` (the GPUs, else the CPU cores), ``gpu``
    or ``cpu`` (the CPU cores, as CPU ranks)."""
    from air_magic.launch.accelerators import detect_gpus

    if value.isdigit():
        return _int("nproc-per-node", value)
    cores = os.cpu_count() or 1
    if value == "auto":
        return len(detect_gpus()) or cores
    if value == "gpu":
        gpus = len(detect_gpus())
        if not gpus:
            raise TorchrunUsageError("--nproc-per-node=gpu: no NVIDIA GPU is visible here")
        return gpus
    if value == "cpu":
        line.force_cpu = True
        return cores
    raise TorchrunUsageError(f"--nproc-per-node={value}: give a number, auto, gpu or cpu")


def _int(name: str, value: Any) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise TorchrunUsageError(f"--{name}={value}: give a whole number") from None
