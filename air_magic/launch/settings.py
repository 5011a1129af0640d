"""Launch settings: one schema, checked the same way from Python, the cell magic and the command line.

Each field of :class:`LaunchSettings` carries a :class:`Setting` in its
``metadata``: its help text, its validator, how a command-line string becomes
a value, and its flag. From that one schema come

- :func:`make_settings`, which the decorator, ``with_overrides`` and the cell
  magic all go through, so a mistake surfaces at decoration time (or before a
  cell launches), not minutes into a run;
- :func:`argument_specs` / :func:`add_arguments`, the argparse options of
  ``%%distributed`` and (issue 17) of the command line;
- :func:`settings_from_args`, the keywords for :func:`make_settings` from the
  options a user gave (defaults stay the dataclass's, in one place).
"""

from __future__ import annotations

import argparse
import functools
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from air_magic.errors import ConfigurationError
from air_magic.launch.accelerators import AcceleratorSpec, AcceleratorType, parse_accelerator_type
from air_magic.protocol import env_names
from air_magic.user_warnings import warn_at_user_line

DEFAULT_TIMEOUT = 10800.0  # the seed's 3 hours
DEFAULT_MAX_PAYLOAD_BYTES = 512 * 2**20
DISPLAY_MODES = ("auto", "tabs", "text", "rank0", "none")


class Unset:
    """A keyword the caller left out; shows as the real default in ``help()`` and editors."""

    def __init__(self, shown: str) -> None:
        self._shown = shown

    def __repr__(self) -> str:
        return self._shown


_UNSET: Any = Unset("<default>")


def unset(default: Any) -> Any:
    """The left-out marker of a keyword whose default is ``default`` (for signatures)."""
    return Unset(repr(default))


# Validators: take what the user gave (any type), return the stored value or raise ConfigurationError.


def _check_count(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ConfigurationError(
            f"num_accelerators must be a whole number of ranks, 1 or more (left out: every visible GPU), "
            f"got {value!r}"
        )
    return int(value)


def _check_type(value: Any) -> AcceleratorSpec | None:
    if value is None:
        return None
    if isinstance(value, AcceleratorSpec):
        return value
    if not isinstance(value, str):
        raise ConfigurationError(f"accelerator_type must be a string such as 'GPU_8xH100', got {value!r}")
    return parse_accelerator_type(value)


def _check_timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(f"timeout must be a number of seconds (or none: no limit), got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"timeout must be a finite number of seconds greater than 0 (or none: no limit), got {value!r}"
        )
    return seconds


def _check_stop_grace(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(f"stop_grace must be a number of seconds (0 or more), got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise ConfigurationError(f"stop_grace must be a finite number of seconds, 0 or more, got {value!r}")
    return seconds


DEFAULT_STOP_GRACE = 30.0  # torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT default


def stop_grace_s(value: float | None) -> float:
    """The grace of a stop: the setting; left out, ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (torchrun's
    variable, read when the call starts), else 30 s."""
    if value is not None:
        return value
    text = os.environ.get(env_names.TORCH_SHUTDOWN_TIMEOUT, "")
    try:
        from_env = float(text)
    except ValueError:
        return DEFAULT_STOP_GRACE
    return from_env if math.isfinite(from_env) and from_env >= 0 else DEFAULT_STOP_GRACE


def _check_cluster(value: Any) -> str | None:
    if value is None or value == "local":
        return None
    if isinstance(value, str):
        kind, sep, address = value.partition("=")
        if kind.strip().lower() == "ray" and (not sep or address.strip()):
            return "ray" + (f"={address.strip()}" if sep else "")
    raise ConfigurationError(
        f"cluster must be None (this machine), 'ray' (the Ray cluster of ray_init() or $RAY_ADDRESS) "
        f"or 'ray=ADDRESS', got {value!r}"
    )


def _check_display(value: Any) -> str:
    if value not in DISPLAY_MODES:
        raise ConfigurationError(f"display must be one of {', '.join(DISPLAY_MODES)}, got {value!r}")
    return str(value)


def _check_env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigurationError("env must be a mapping of str to str (extra environment for every rank)")
    for name, text in value.items():
        # What the OS refuses at the rank's start (every rank would fail there, each the same way).
        if not name or "=" in name or "\0" in name:
            raise ConfigurationError(f"env: {name!r} cannot be an environment variable's name")
        if "\0" in text:
            raise ConfigurationError(f"env: the value of {name} holds a NUL, which no environment can")
        if name in env_names.SET_BY_THE_LAUNCHER:
            raise ConfigurationError(
                f"env: {name} is set by air_magic for each rank (where it stands, its peers, its caller) "
                "and cannot be given; num_accelerators= chooses the number of ranks"
            )
    return dict(value)


def _check_log_dir(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"log_dir must be a path, got {value!r}")
    return os.fspath(value)


def _check_payload_limit(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ConfigurationError(f"max_payload_bytes must be a positive integer, got {value!r}")
    return int(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def _check_run_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise ConfigurationError(
            f"mlflow_run_id must be an MLflow run id (a string without spaces), got {value!r}"
        )
    return value


def _check_name(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{name} must be a non-empty string, got {value!r}")
    return value


# Parsers: one command-line string to the value a Python caller would pass; ValueError if it is not one.


def _parse_timeout(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text)


def _parse_env(text: str) -> dict[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(text)
    return {key.strip(): value}


@dataclass(frozen=True)
class Setting:
    """What the schema knows of one setting; it lives in its field's ``metadata`` under ``"setting"``.

    ``help`` is shared by the decorator's docstring and every command line, so
    it names no spelling of its own (``None``/``none``, ``True``/``--x``): each
    surface adds that (``takes``, the metavar, ``--x/--no-x``).
    """

    help: str
    check: Callable[[Any], Any]
    parse: Callable[[str], Any] = str
    takes: str = "a value"  # what ``parse`` accepts, for its error message
    short: str | None = None
    flag: str | None = None  # default: ``--`` and the name with dashes
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # a boolean: ``--x`` / ``--no-x``
    repeat: bool = False  # a mapping: the flag once per ``KEY=VALUE``, merged
    default_text: str | None = None  # shown instead of the field's default ("" shows none)
    alias: str | None = None  # a former name, still accepted: as a keyword and as its flag


def _about(setting: Setting) -> dict[str, Setting]:
    return {"setting": setting}


def _setting(default: Any = None, *, default_factory: Any = MISSING, **about: Any) -> Any:
    """A field of LaunchSettings: its default (left out: None) and how it is checked, shown and
    spelled (Setting)."""
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=_about(Setting(**about)))
    return field(default=default, metadata=_about(Setting(**about)))


def _switch(name: str, default: bool, help: str) -> Any:
    """A True/False setting: ``--name`` / ``--no-name`` on a command line."""
    return _setting(default, help=help, check=functools.partial(_check_bool, name), switch=True)


def _name(name: str, help: str, default_text: str) -> Any:
    """A name (a non-empty string), left out by default."""
    check = functools.partial(_check_name, name)
    return _setting(help=help, check=check, metavar="NAME", default_text=default_text)


@dataclass(frozen=True)
class LaunchSettings:
    """Validated settings of one decorated function. Immutable; copy with overrides.

    Every field but ``raw`` is a setting; its ``metadata["setting"]`` says how
    it is documented, checked and spelled on a command line.
    """

    num_accelerators: int | None = _setting(
        help="ranks to run, one per GPU",
        check=_check_count,
        parse=int,
        takes="a positive integer",
        short="-n",
        metavar="N",
        default_text="every visible GPU; 2 CPU ranks without a GPU",
    )
    accelerator_type: AcceleratorSpec | None = _setting(
        help="the GPUs expected, GPU_<count>x<MODEL> such as GPU_8xH100, checked against the machine",
        check=_check_type,
        metavar="TYPE",
        default_text="detected",
    )
    timeout: float | None = _setting(
        DEFAULT_TIMEOUT,
        help="seconds before the call is stopped",
        check=_check_timeout,
        parse=_parse_timeout,
        takes="seconds or 'none'",
        metavar="SECONDS|none",
    )
    stop_grace: float | None = _setting(
        help="seconds the ranks get to end on their own after a stop (the stop button, Ctrl-C, "
        "a signal to the command line, cancel()) before they are killed: they get SIGINT "
        "(KeyboardInterrupt), or the signal the command line got, as torchrun forwards it",
        check=_check_stop_grace,
        parse=float,
        takes="seconds",
        metavar="SECONDS",
        default_text="$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30",
    )
    display: str = _setting(
        "auto",
        help="how rank output is shown: auto (live tabs in Jupyter, else text), tabs, "
        "text (lines prefixed with the rank), rank0 (rank 0's lines only) or none",
        check=_check_display,
        choices=DISPLAY_MODES,
        metavar="MODE",
    )
    env: Mapping[str, str] = _setting(
        default_factory=dict,
        help="extra environment variables for every rank",
        check=_check_env,
        parse=_parse_env,
        takes="KEY=VALUE",
        metavar="KEY=VALUE",
        repeat=True,
        default_text="",
    )
    log_dir: str | None = _setting(
        help="the folder for the call's rank logs",
        check=_check_log_dir,
        metavar="PATH",
        default_text="$AIR_MAGIC_LOG_DIR, else ~/.local/state/air_magic/runs",
    )
    max_payload_bytes: int = _setting(
        DEFAULT_MAX_PAYLOAD_BYTES,
        help="the most bytes the pickled function and arguments may take",
        check=_check_payload_limit,
        parse=int,
        takes="a positive integer",
        metavar="BYTES",
        default_text=f"{DEFAULT_MAX_PAYLOAD_BYTES // 2**20} MiB",
    )
    tracking: bool = _switch("tracking", True, "record the call as an MLflow run, when mlflow is installed")
    warm_start: bool = _switch(
        "warm_start",
        True,
        "fork ranks from a starter process that has imported torch once, "
        "instead of starting fresh interpreters",
    )
    cluster: str | None = _setting(
        help="where the ranks run: this machine, or 'ray' (every node of a Ray cluster; "
        "'ray=ADDRESS' names the cluster)",
        check=_check_cluster,
        metavar="ray[=ADDRESS]",
        default_text="this machine",
    )
    share_gpus: bool = _switch(
        "share_gpus",
        False,
        "run even on GPUs that a background run of this process is using "
        "(both then share their memory and time)",
    )
    detach: bool = _switch(
        "detach",
        False,
        "run the ranks under a small supervisor process that outlives this kernel "
        "(or terminal): air_magic.attach() re-opens the run from any kernel. With cluster='ray' "
        "the supervisor is a Ray job on the cluster, followed from any machine (docs/ray.md)",
    )
    experiment: str | None = _name(
        "experiment", "the MLflow experiment", "MLflow's own, else the notebook's or script's name"
    )
    run_name: str | None = _name("run_name", "the MLflow run's name", "MLflow's")
    mlflow_run_id: str | None = _setting(
        help="an existing MLflow run to record this call in (resume it) instead of a new run",
        check=_check_run_id,
        metavar="RUN_ID",
        default_text="a new run (MLFLOW_RUN_ID set here resumes that run)",
        alias="run_id",
    )
    system_metrics: bool = _switch(
        "system_metrics",
        True,
        "log this machine's CPU, memory, disk, network and GPU use to the run under system/ "
        "(every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds, 10 by default)",
    )

    # The user's own spelling of every setting, so overrides re-validate as one.
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def run_id(self) -> str | None:
        """The former name of :attr:`mlflow_run_id`, read-only (for code that still reads it)."""
        return self.mlflow_run_id


def _field_default(f: Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


# The schema, in field order (the order of the help and of validation).
SETTINGS: dict[str, Setting] = {
    f.name: f.metadata["setting"] for f in fields(LaunchSettings) if "setting" in f.metadata
}
DEFAULTS: dict[str, Any] = {f.name: _field_default(f) for f in fields(LaunchSettings) if f.name in SETTINGS}
_LEGACY_NAMES = {"gpus": "num_accelerators", "gpu_type": "accelerator_type"}
# Former names of settings (``Setting.alias``): still accepted as they are, without a warning.
ALIASES: dict[str, str] = {s.alias: name for name, s in SETTINGS.items() if s.alias is not None}


def make_settings(base: Mapping[str, Any] | None = None, **given: Any) -> LaunchSettings:
    """Validate ``given`` (keyword settings, legacy names allowed) on top of ``base``."""
    given = {k: v for k, v in given.items() if not isinstance(v, Unset)}
    given = _translate_legacy(_translate_aliases(given))
    raw = {**_translate_aliases(dict(base or {})), **given}
    unknown = set(raw) - set(SETTINGS)
    if unknown:
        raise ConfigurationError(
            f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(SETTINGS))}"
        )
    checked = {name: s.check(raw.get(name, DEFAULTS[name])) for name, s in SETTINGS.items()}
    if checked["mlflow_run_id"] is not None and not checked["tracking"]:
        raise ConfigurationError(
            f"mlflow_run_id={checked['mlflow_run_id']!r} (--mlflow-run-id) names the MLflow run to record "
            "the call into, and tracking=False (--no-tracking) records nothing: give one of the two"
        )
    return LaunchSettings(**checked, raw=raw)


def _translate_aliases(given: dict[str, Any]) -> dict[str, Any]:
    """A setting's former name (``run_id=``) to its name (``mlflow_run_id=``). Both given: they must
    agree (None is no value: the decorator passes both)."""
    out = dict(given)
    for old, new in ALIASES.items():
        if old not in out:
            continue
        value, other = out.pop(old), out.get(new)
        if value is not None and other is not None and value != other:
            raise ConfigurationError(  # said in both spellings: a keyword's and a command line's
                f"both {old}={value!r} ({_long_flag(old)}) and {new}={other!r} ({_long_flag(new)}) were "
                f"given; {old} is the former name of {new}: give only {new}= ({_long_flag(new)})"
            )
        if other is None:
            out[new] = value
    return out


def _translate_legacy(given: dict[str, Any]) -> dict[str, Any]:
    """Map ``gpus``/``gpu_type`` and legacy type values to today's names, with one FutureWarning."""
    out = dict(given)
    if out.pop("remote", False):
        raise ConfigurationError(
            "remote=True (the hosted product's pool of remote GPUs) has no equivalent here: ranks run "
            "on this machine. For other machines use cluster='ray' (docs/ray.md), or run "
            "`air-magic run script.py` on the machine that has the GPUs"
        )
    replacements: list[str] = []
    for old, new in _LEGACY_NAMES.items():
        if old not in out:
            continue
        value = out.pop(old)
        if value is None:
            continue
        if given.get(new) is not None:
            raise ConfigurationError(
                f"both {old}= and {new}= were given; {old} is the legacy name of {new}, use only {new}="
            )
        out[new] = value
        replacements.append(f"{old}= -> {new}=")
    accel = out.get("accelerator_type")
    if accel is not None and not isinstance(accel, AcceleratorType):
        spec = _check_type(accel)
        if spec is not None and spec.legacy:
            from air_magic.launch.accelerators import LEGACY_TYPES

            count = out.get("num_accelerators")
            # A legacy value named a model only; with a count given, the type that says both.
            suggested = (
                f"GPU_{count}x{spec.model}"
                if isinstance(count, int) and not isinstance(count, bool) and count > 0
                else LEGACY_TYPES[str(accel).strip().lower()]
            )
            replacements.append(f"{str(accel)!r} -> {suggested!r}")
    if replacements:
        warn_at_user_line(
            "air_magic: legacy setting(s) used; they still work but will be removed: "
            + "; ".join(replacements),
            FutureWarning,
        )
    return out


# Command lines: the cell magic now, ``air-magic run`` later (issue 17).


def flags_of(name: str) -> tuple[str, ...]:
    """The option strings of a setting: ``('-n', '--num-accelerators')``, ``('--timeout',)``,
    ``('--mlflow-run-id', '--run-id')`` (its former name last)..."""
    setting = SETTINGS[name]
    long = setting.flag or _long_flag(name)
    flags = (setting.short, long) if setting.short else (long,)
    return (*flags, _long_flag(setting.alias)) if setting.alias else flags


def _long_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def help_of(name: str) -> str:
    """A setting's help with its default, as a command line shows it."""
    setting = SETTINGS[name]
    shown = setting.default_text
    if shown is None:
        default = DEFAULTS[name]
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, float):
            shown = f"{default:g}"
        else:
            shown = str(default)
    text = f"{setting.help} (default: {shown})" if shown else setting.help
    if setting.alias:
        text += f"; {_long_flag(setting.alias)} is its former name, still accepted"
    # argparse %-formats help strings: a literal % must be doubled.
    return text.replace("%", "%%")


def argument_specs() -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """``(flags, keywords)`` for ``add_argument``, one per setting, in schema order.

    Every option defaults to ``argparse.SUPPRESS``: an option not given leaves
    no attribute, so :func:`settings_from_args` passes only what the user said
    and the defaults stay the dataclass's.
    """
    specs: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    for name, setting in SETTINGS.items():
        keywords: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_of(name)}
        if setting.switch:
            keywords["action"] = argparse.BooleanOptionalAction
        else:
            keywords["type"] = _string_type(name)
            keywords["metavar"] = setting.metavar
            if setting.choices is not None:
                keywords["choices"] = setting.choices
            if setting.repeat:
                keywords["action"] = _MergeAction
        own = flags_of(name)[:-1] if setting.alias else flags_of(name)
        specs.append((own, keywords))
        if setting.alias:
            # The former name's flag keeps its own dest, so both on one line reach make_settings,
            # which refuses them when they differ (argparse alone would keep the last).
            former = {**keywords, "dest": setting.alias, "help": argparse.SUPPRESS}
            specs.append(((_long_flag(setting.alias),), former))
    return specs


def add_arguments(parser: argparse._ActionsContainer) -> None:
    """Add every setting as an option of ``parser`` (or of an argument group)."""
    for flags, keywords in argument_specs():
        parser.add_argument(*flags, **keywords)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`make_settings` keywords of the setting options present in ``args``."""
    names = (*SETTINGS, *ALIASES)  # a former name's flag keeps its own dest (see argument_specs)
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _string_type(name: str) -> Callable[[str], Any]:
    """An argparse ``type=`` for a setting: parse the string, then validate it as Python would.

    Checking here makes a bad value an argparse error that names the option
    (``argument --timeout: ...``). It returns the parsed value, not the checked
    one, so :func:`make_settings` still sees the user's spelling (a legacy
    accelerator type warns there).
    """
    setting = SETTINGS[name]

    def convert(text: str) -> Any:
        try:
            value = setting.parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {setting.takes}, not {text!r}") from None
        try:
            setting.check(value)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    convert.__name__ = name  # argparse names the type in some messages
    return convert


class _MergeAction(argparse.Action):
    """``--env A=1 --env B=2``: merge each given mapping into one (a repeated key: the last wins)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        merged = dict(getattr(namespace, self.dest, None) or {})
        if isinstance(values, Mapping):  # always: the type= above made it one
            merged.update(values)
        setattr(namespace, self.dest, merged)
