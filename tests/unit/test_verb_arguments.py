"""Each verb's arguments are specified once (air_magic/verbs.py) and both surfaces parse them with
that spec before the verb's handler runs: ``air-magic VERB`` and ``%distributed VERB`` refuse the
same bad or extra words, with a clear message and nothing run, and read the valid ones the same."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest

from air_magic import verbs

pytest.importorskip("IPython")
from IPython.core.error import UsageError

from air_magic import cli
from air_magic.notebook import magics  # noqa: F401


class Recorder:
    """Stands in for a verb's handler: what it was given, and that it ran at all."""

    def __init__(self, value: Any = None) -> None:
        self.calls: list[Any] = []
        self.value = value

    def __call__(self, given: Any) -> Any:
        self.calls.append(given)
        return self.value


@pytest.fixture
def recorded(monkeypatch):
    """``recorded(verb, surface)``: that verb's handler on that surface replaced by a Recorder."""

    def replace(name: str, surface: verbs.Surface) -> Recorder:
        recorder = Recorder(0 if surface == "cli" else None)
        monkeypatch.setitem(verbs._HANDLERS[surface], name, recorder)
        return recorder

    return replace


# (verb, the words after it, what the refusal says): refused on both surfaces alike.
REFUSED_ON_BOTH = [
    ("runs", "-n abc", "argument -n: invalid int value: 'abc'"),
    ("runs", "-n 0", "argument -n: must be 1 or more, not 0"),
    ("runs", "-n -3", "argument -n: must be 1 or more, not -3"),
    ("runs", "extra", "unrecognized arguments: extra"),
    ("logs", "1 2", r"logs takes \[RUN\] \[RANK\]"),
    ("logs", "a b c", "unrecognized arguments: c"),
    ("stack", "RUN 1 2", "unrecognized arguments: 2"),
    ("attach", "one two", "unrecognized arguments: two"),
    ("cancel", "one two", "unrecognized arguments: two"),
    ("ui", "--bogus", "unrecognized arguments: --bogus"),
    ("ui", "--run", "argument --run: expected one argument"),
]

# The magic's own verbs.
REFUSED_ON_THE_MAGIC = [
    ("settings", "extra", "unrecognized arguments: extra"),
    ("status", "now", "unrecognized arguments: now"),
    ("help", "me", "unrecognized arguments: me"),
    ("restart", "--force", "unrecognized arguments: --force"),
    ("session", "restart -n 3", "session restart takes no options"),
    ("session", "stop now", "session stop takes no options"),
    ("session", "status -n 2", "session status takes no options"),
    ("session", "bogus", "invalid choice: 'bogus'"),
    ("session", "--bogus", "unrecognized arguments: --bogus"),
    ("runs", "--log-dir /tmp", "unrecognized arguments: --log-dir"),  # the command line's only
    ("attach", "--json", "unrecognized arguments: --json"),
]


@pytest.mark.parametrize(("name", "words", "said"), REFUSED_ON_BOTH + REFUSED_ON_THE_MAGIC)
def test_the_magic_refuses_bad_or_extra_words_naming_the_verb_and_its_usage(ip, recorded, name, words, said):
    handler = recorded(name, "magic")
    with pytest.raises(UsageError, match=said) as refused:
        ip.run_line_magic("distributed", f"{name} {words}")
    first, usage = str(refused.value).split("\n")
    assert first.startswith(f"%distributed {name}: "), first
    assert usage == verbs.verb_parser(name, "magic").format_usage().strip()
    assert usage.startswith(f"usage: %distributed {name}")
    assert handler.calls == []  # nothing ran


@pytest.mark.parametrize(("name", "words", "said"), REFUSED_ON_BOTH)
def test_the_command_line_refuses_the_same_words_in_one_line_with_status_2(
    capsys, recorded, name, words, said
):
    handler = recorded(name, "cli")
    assert cli.main([name, *words.split()]) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"air-magic {name}: ")
    assert re.search(said, line), line
    assert handler.calls == []


def test_the_command_lines_own_refusals(capsys, recorded):
    handler = recorded("cancel", "cli")
    assert cli.main(["cancel"]) == cli.USAGE_ERROR  # the command line's cancel names its RUN
    assert "the following arguments are required: RUN" in capsys.readouterr().err
    assert handler.calls == []


@pytest.mark.parametrize(
    ("name", "words", "expected"),
    [
        ("runs", "", {"n": 20}),
        ("runs", "-n 5", {"n": 5}),
        ("logs", "", {"run": "last", "rank": None}),
        ("logs", "1", {"run": "last", "rank": 1}),
        ("logs", "20261203-1 0", {"run": "20261203-1", "rank": 0}),
        ("logs", "0 20261203-1", {"run": "20261203-1", "rank": 0}),
        ("logs", "last 2", {"run": "last", "rank": 2}),
        ("stack", "", {"run": None, "rank": None}),
        ("stack", "1", {"run": None, "rank": 1}),
        ("stack", "20261203-1 3", {"run": "20261203-1", "rank": 3}),
        ("attach", "", {"run": None}),
        ("attach", "20261203", {"run": "20261203"}),
        ("cancel", "20261203", {"run": "20261203"}),
        ("ui", "", {"run": None}),
        ("ui", "--run abc123", {"run": "abc123"}),
    ],
)
def test_valid_words_mean_the_same_on_both_surfaces(ip, recorded, name, words, expected):
    on_magic, on_cli = recorded(name, "magic"), recorded(name, "cli")
    ip.run_line_magic("distributed", f"{name} {words}".strip())
    (given,) = on_magic.calls
    assert vars(given) == expected
    if name == "cancel" or words:  # the command line's cancel needs its RUN
        assert cli.main([name, *words.split()]) == 0
        (from_cli,) = on_cli.calls
        assert {k: v for k, v in vars(from_cli).items() if k in expected} == expected


def test_the_command_lines_own_options_still_parse(recorded):
    runs, logs, ui = recorded("runs", "cli"), recorded("logs", "cli"), recorded("ui", "cli")
    assert cli.main(["runs", "--log-dir", "/x", "-n", "3", "--cluster", "ray"]) == 0
    assert vars(runs.calls[0]) == {"log_dir": "/x", "n": 3, "cluster": "ray"}
    assert cli.main(["logs", "--log-dir", "/x", "RUN", "1", "--cluster", "ray=h:6379"]) == 0
    assert vars(logs.calls[0]) == {"log_dir": "/x", "run": "RUN", "rank": 1, "cluster": "ray=h:6379"}
    assert cli.main(["ui", "--store", "sqlite:///s.db", "--stop"]) == 0
    assert vars(ui.calls[0]) == {"store": "sqlite:///s.db", "run": None, "stop": True}


def test_session_start_hands_its_options_on_split_as_a_shell_would(ip, recorded):
    session = recorded("session", "magic")
    ip.run_line_magic("distributed", """session start -n 2 --run-name "my run" --display text""")
    ip.run_line_magic("distributed", "session")
    ip.run_line_magic("distributed", "session restart")
    assert [vars(given) for given in session.calls] == [
        {"action": "start", "options": ["-n", "2", "--run-name", "my run", "--display", "text"]},
        {"action": "status", "options": []},
        {"action": "restart", "options": []},
    ]


def test_a_bare_line_is_status_and_the_ui_verbs_first_name_parses_as_ui(ip, recorded):
    status, ui = recorded("status", "magic"), recorded("ui", "magic")
    ip.run_line_magic("distributed", "")
    ip.run_line_magic("distributed", "mlflow-ui --run abc")
    assert vars(status.calls[0]) == {}
    assert vars(ui.calls[0]) == {"run": "abc"}


def test_a_verb_without_arguments_refuses_any_for_real(ip):
    """The real handlers, not recorders: the words are refused before they run."""
    for line in ("settings extra", "help me", "status now"):
        with pytest.raises(UsageError, match="unrecognized arguments"):
            ip.run_line_magic("distributed", line)


@pytest.mark.parametrize("name", [n for n in verbs.names("magic") if n != "session"])
def test_the_help_tables_usage_is_the_magics_spec(name):
    """The table's ``args`` column (what both help lists show) is the usage the spec makes."""
    usage = verbs.verb_parser(name, "magic").format_usage().strip()
    assert usage == f"usage: %distributed {name} {verbs.VERB[name].args}".strip()


@pytest.mark.parametrize("surface", ["cli", "magic"])
def test_every_verb_of_a_surface_but_run_has_a_parser_there(surface):
    for name in verbs.names(surface):
        if name == "run":  # its TARGET and the settings schema's options: cli.py's own parser
            assert verbs.parse("run", "cli", ["-n", "2", "x.py"]) == ["-n", "2", "x.py"]
            continue
        assert isinstance(verbs.verb_parser(name, surface), argparse.ArgumentParser)
    with pytest.raises(ValueError, match="no magic parser of 'run'"):
        verbs.verb_parser("run", "magic")


def test_the_command_lines_help_says_what_it_said(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["attach", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: air-magic attach [-h] [--json] [--cluster ray[=ADDRESS]] [RUN]")
    assert "Ctrl-C stops following; the run goes on." in " ".join(out.split())
