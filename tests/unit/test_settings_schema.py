"""One settings schema: the decorator, ``%%distributed`` and the command line agree (issue 14).

The schema is the metadata of ``LaunchSettings``' fields. These tests fail when
a setting is added to (or renamed in) one surface and not the others. No rank
is started: the cell magic's launch is replaced by a stub that reports the
settings it was given.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing

import pytest

pytest.importorskip("IPython")
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from air_magic import distributed
from air_magic.calls import call as session
from air_magic.launch import settings as schema
from air_magic.launch.settings import DEFAULTS, SETTINGS, LaunchSettings, make_settings
from air_magic.notebook import magics

LEGACY = {"gpus", "gpu_type", "remote"}  # the seed's names, not settings
ALIASES = set(schema.ALIASES)  # former names of settings, still accepted: run_id
MAGIC_ONLY = {"--push", "--pull", "--no-pull", "--cold", "--background"}
SEED_POSITIONAL = ["num_accelerators", "accelerator_type", "timeout"]

# Every setting with a value other than its default, as a Python keyword and as an option.
EVERY_SETTING = (
    {
        "num_accelerators": 3,
        "accelerator_type": "GPU_2xH200",
        "timeout": 12.5,
        "stop_grace": 5.0,
        "display": "text",
        "env": {"A": "1", "B": "x=y"},
        "log_dir": "/tmp/air_magic-schema-logs",
        "max_payload_bytes": 1024,
        "tracking": True,  # False would refuse mlflow_run_id (--no-tracking has its own cases)
        "warm_start": False,
        "cluster": "ray=127.0.0.1:6379",
        "share_gpus": True,
        "detach": False,  # --no-detach here
        "experiment": "exp",
        "run_name": "run-1",
        "mlflow_run_id": "0123abcd",
        "system_metrics": False,
    },
    "-n 3 --accelerator-type GPU_2xH200 --timeout 12.5 --stop-grace 5 --display text --env A=1 --env B=x=y "
    "--log-dir /tmp/air_magic-schema-logs --max-payload-bytes 1024 --tracking --no-warm-start "
    "--cluster ray=127.0.0.1:6379 --share-gpus --no-detach --experiment exp --run-name run-1 "
    "--mlflow-run-id 0123abcd --no-system-metrics",
)


class _Launched(Exception):
    def __init__(self, settings: LaunchSettings):
        self.settings = settings


def _no_launch(name, fn, bound, settings, **kwargs):
    raise _Launched(settings)


@pytest.fixture
def ip(ip, monkeypatch):
    """The shared shell (conftest.py), whose cells stop where they would launch."""
    monkeypatch.setattr(session, "run_call", _no_launch)
    return ip


def magic_settings(ip, line: str) -> LaunchSettings:
    with pytest.raises(_Launched) as launched:
        ip.run_cell_magic("distributed", line, "1\n")
    return launched.value.settings


def squash(text: str) -> str:
    """Text without whitespace: help is wrapped differently by argparse and in a docstring."""
    return "".join(text.split())


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def schema_parser() -> argparse.ArgumentParser:
    """The schema's options in a plain parser, as the command line (issue 17) will build it."""
    parser = argparse.ArgumentParser(add_help=False)
    schema.add_arguments(parser)
    return parser


def test_every_field_is_a_setting_with_help():
    names = [f.name for f in dataclasses.fields(LaunchSettings) if f.name != "raw"]
    assert list(SETTINGS) == names
    for name, setting in SETTINGS.items():
        assert setting.help.strip(), f"{name} has no help text"


def test_the_decorators_parameters_are_the_schema():
    params = inspect.signature(distributed).parameters
    assert set(params) == set(SETTINGS) | LEGACY | ALIASES
    positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == SEED_POSITIONAL  # the seed's order: distributed(2, "GPU_8xH100", 60)
    get_overloads = getattr(typing, "get_overloads", None)  # Python 3.11+
    if get_overloads is not None:
        with_settings = get_overloads(distributed)[-1]
        assert list(inspect.signature(with_settings).parameters) == list(params)


def test_the_decorators_defaults_are_the_schemas():
    """A keyword left out gives the dataclass's default: defaults live in one place."""
    assert distributed()(len).settings == LaunchSettings(**DEFAULTS) == make_settings()
    for name, param in inspect.signature(distributed).parameters.items():
        if name not in LEGACY:
            assert make_settings(**{name: param.default}) == make_settings(), name


def test_the_magics_options_are_the_schema_and_its_own():
    magic = option_strings(magics.DistributedMagics.distributed.parser)
    shared = option_strings(schema_parser())
    assert shared <= magic
    assert magic - shared == MAGIC_ONLY
    dests = {a.dest for a in magics.DistributedMagics.distributed.parser._actions}
    assert dests == set(SETTINGS) | set(schema.ALIASES) | {
        "push",
        "pull",
        "no_pull",
        "background",
    }  # --cold sets warm_start


def test_flags_are_spelled_like_the_keywords():
    shared = option_strings(schema_parser())
    for name, setting in SETTINGS.items():
        long = "--" + name.replace("_", "-")
        assert long in shared
        if setting.switch:
            assert "--no-" + long[2:] in shared
    assert {"-n", "--tracking", "--no-tracking", "--warm-start", "--no-warm-start"} <= shared


def test_cold_is_an_alias_of_no_warm_start():
    parser = magics.DistributedMagics.distributed.parser
    (cold,) = [a for a in parser._actions if "--cold" in a.option_strings]
    assert cold.dest == "warm_start" and cold.const is False
    assert "--no-warm-start" in cold.help


def test_options_not_given_leave_no_keyword():
    """Only what the user typed reaches make_settings, so the dataclass's defaults apply."""
    parser = schema_parser()
    assert schema.settings_from_args(parser.parse_args([])) == {}
    given = schema.settings_from_args(parser.parse_args(["--timeout", "none", "--no-tracking"]))
    assert given == {"timeout": None, "tracking": False}


def test_every_setting_has_a_case_below():
    assert set(EVERY_SETTING[0]) == set(SETTINGS)


@pytest.mark.parametrize(
    ("keywords", "line"),
    [
        EVERY_SETTING,
        ({}, ""),
        ({"timeout": None, "tracking": True, "warm_start": False}, "--timeout NONE --tracking --cold"),
        ({"warm_start": True, "env": {"A": "2"}}, "--cold --warm-start --env A=1 --env A=2"),
        ({"num_accelerators": 2, "timeout": 60}, "--num-accelerators 2 --timeout 60"),
        ({"run_id": "0123abcd"}, "--mlflow-run-id 0123abcd"),  # the former names, both surfaces
        ({"mlflow_run_id": "0123abcd"}, "--run-id 0123abcd"),
    ],
)
def test_keywords_and_magic_line_give_equal_settings(ip, keywords, line):
    from_python = distributed(**keywords)(len).settings
    from_magic = magic_settings(ip, line)
    assert from_magic == from_python
    assert make_settings(from_magic.raw) == from_python  # overrides re-validate the same


def test_every_help_is_in_the_decorators_docstring():
    doc = squash(distributed.__doc__ or "")
    for name, setting in SETTINGS.items():
        assert squash(setting.help) in doc, name
        assert f"``{name}``" in doc, name


def test_every_help_is_in_the_magics_help(ip):
    with capture_output() as captured:
        ip.run_cell("%%distributed?")
    shown = squash(captured.stdout)
    for name, setting in SETTINGS.items():
        assert squash(setting.help) in shown, name
        for flag in schema.flags_of(name):
            assert flag in captured.stdout, flag
    for flag in MAGIC_ONLY:
        assert flag in captured.stdout


@pytest.mark.parametrize(
    ("line", "flag"),
    [
        ("-n 0", "--num-accelerators"),
        ("-n two", "--num-accelerators"),
        ("--accelerator-type H200x2", "--accelerator-type"),
        ("--timeout soon", "--timeout"),
        ("--timeout nan", "--timeout"),
        ("--timeout -1", "--timeout"),
        ("--display fancy", "--display"),
        ("--env NOVALUE", "--env"),
        ("--max-payload-bytes 0", "--max-payload-bytes"),
        ("--tracking=yes", "--tracking"),
        ("--run-name", "--run-name"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_option(ip, line, flag):
    with pytest.raises(UsageError, match=re.escape(flag)):
        ip.run_cell_magic("distributed", line, "1\n")  # the stub would raise _Launched


def test_quoted_values_are_split_as_a_shell_would(ip):
    made = magic_settings(ip, """--run-name "my first run" --experiment 'lr sweep' --env A='x y'""")
    assert (made.run_name, made.experiment, dict(made.env)) == ("my first run", "lr sweep", {"A": "x y"})
