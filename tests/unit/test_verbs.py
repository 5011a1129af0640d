"""One table of verbs for both surfaces (air_magic/verbs.py): the help of each is made from it, and
each dispatches from it."""

from __future__ import annotations

import pytest

from air_magic import verbs
from air_magic.errors import ConfigurationError


def test_both_surfaces_list_the_shared_verbs_and_only_their_own():
    cli, magic = verbs.help_text("cli"), verbs.help_text("magic")
    for shared in ("runs", "logs", "attach", "stack", "cancel", "ui"):
        assert f"air-magic {shared}" in cli and f"%distributed {shared}" in magic
    assert "air-magic status" not in cli and "%distributed run " not in magic
    assert "%%distributed [options]" in magic


def test_the_command_line_and_the_magic_take_their_verbs_from_the_table():
    from air_magic import cli
    from air_magic.notebook import magics

    parser = cli._parser()
    (command,) = [a for a in parser._actions if a.dest == "command"]
    assert list(command.choices) == verbs.names("cli")
    assert verbs.help_text("magic") == magics._HELP
    assert verbs.help_text("magic") in (magics.DistributedMagics.distributed_line.__doc__ or "")


@pytest.mark.parametrize("surface", ["cli", "magic"])
def test_each_surface_handles_exactly_the_verbs_the_table_gives_it(surface):
    from air_magic import cli  # noqa: F401 - importing a surface registers its handlers
    from air_magic.notebook import magics  # noqa: F401

    assert sorted(verbs.handlers(surface)) == sorted(verbs.names(surface))


def test_a_verb_the_table_lacks_cannot_be_registered_nor_found():
    for name, surface in (("frobnicate", "cli"), ("status", "cli"), ("run", "magic")):
        with pytest.raises(ValueError, match=f"no {surface} verb '{name}'"):
            verbs.handles(name, surface)
        assert verbs.handler(name, surface) is None


def test_the_magic_takes_the_ui_verbs_first_name():
    from air_magic.notebook import magics  # noqa: F401

    assert verbs.handler("mlflow-ui", "magic") is verbs.handler("ui", "magic") is not None
    assert verbs.handler("mlflow-ui", "cli") is None


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ([], ("last", None)),
        (["1"], ("last", 1)),
        (["20261203-1", "0"], ("20261203-1", 0)),
        (["last", "2"], ("last", 2)),
    ],
)
def test_logs_takes_an_optional_run_and_an_optional_rank(words, expected):
    assert verbs.split_logs_args(words) == expected


def test_logs_refuses_two_runs_or_two_ranks():
    for words in (["last", "20261203-1"], ["1", "2"]):
        with pytest.raises(ConfigurationError, match=r"logs takes \[RUN\] \[RANK\]"):
            verbs.split_logs_args(words)


def test_logs_of_an_unknown_call_or_rank_says_so(tmp_path):
    with pytest.raises(ConfigurationError, match="no call 'nope'"):
        verbs.logs("nope", None, str(tmp_path))
