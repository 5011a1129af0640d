"""``%%distributed`` and ``%distributed`` in a real IPython shell (SPEC §1, §8)."""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import air_magic


def cell(ip, line, body):
    with capture_output() as captured:
        result = ip.run_cell_magic("distributed", line, body)
    return result, captured


def test_load_and_unload_register_and_remove_both_magics():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "air_magic")
    assert "distributed" in shell.magics_manager.magics["cell"]
    assert "distributed" in shell.magics_manager.magics["line"]
    shell.run_line_magic("unload_ext", "air_magic")
    assert "distributed" not in shell.magics_manager.magics["cell"]
    assert "distributed" not in shell.magics_manager.magics["line"]


def test_names_are_sent_and_assigned_names_come_back_from_rank_0(ip):
    ip.run_cell("import math as m\nbase = 10\ndef helper(v):\n    return v * 2\nclass Box:\n    k = 3\n")
    result, captured = cell(
        ip,
        "-n 2 --display text",
        "import os\n"
        "rank = int(os.environ['RANK'])\n"
        "print('hello from', rank, round(m.pi, 2))\n"
        "value = helper(base) + Box.k + rank\n"
        "rank * 100\n",
    )
    assert result == [0, 100]  # every rank's last expression, in rank order
    assert ip.user_ns["value"] == 23 and ip.user_ns["rank"] == 0  # from rank 0
    assert "[rank 1] hello from 1 3.14" in captured.stdout
    assert "brought back from rank 0: rank, value" in captured.stdout
    assert air_magic.last_run().values == [0, 100]


def test_a_cell_without_a_final_expression_returns_nothing(ip):
    result, _ = cell(ip, "-n 2 --display none", "x_assigned = 5\n")
    assert result is None and ip.user_ns["x_assigned"] == 5


def test_pull_narrows_and_no_pull_brings_nothing(ip):
    ip.user_ns.pop("a1", None)
    ip.user_ns.pop("b1", None)
    cell(ip, "-n 2 --display none --pull b1", "a1 = 1\nb1 = 2\n")
    assert "a1" not in ip.user_ns and ip.user_ns["b1"] == 2
    ip.user_ns.pop("b1")
    cell(ip, "-n 2 --display none --no-pull", "a1 = 1\nb1 = 2\n")
    assert "a1" not in ip.user_ns and "b1" not in ip.user_ns


def test_push_sends_names_the_analysis_cannot_see(ip):
    ip.run_cell("hidden_value = 41")
    result, _ = cell(ip, "-n 2 --display none --push hidden_value", "globals()['hidden_value'] + 1\n")
    assert result == [42, 42]
    with pytest.raises(UsageError, match="no such name"):
        cell(ip, "-n 2 --push not_defined_anywhere", "1\n")


def test_unpicklable_names_are_named_before_launch(ip):
    ip.run_cell("import threading\nguard = threading.Lock()")
    before = air_magic.last_run()
    with pytest.raises(air_magic.PayloadError, match="notebook variable 'guard'"):
        cell(ip, "-n 2", "print(guard)\n")
    assert air_magic.last_run() is before


def test_unpicklable_results_are_listed_not_fatal(ip):
    _, captured = cell(
        ip, "-n 2 --display none", "import threading\nok_value = 1\nbad_value = threading.Lock()\n"
    )
    assert ip.user_ns["ok_value"] == 1
    assert "not brought back: bad_value" in captured.stdout


def test_a_rank_error_renders_the_ranks_traceback_and_the_shell_stays_usable(ip):
    with capture_output() as captured:
        result = ip.run_cell(
            "%%distributed -n 2 --display none\n"
            "import os\n"
            "if os.environ['RANK'] == '1':\n"
            "    raise KeyError('lost')\n"
        )
    assert isinstance(result.error_in_exec, KeyError)
    shown = captured.stdout + captured.stderr
    assert "rank 1 of 2" in shown and "raise KeyError('lost')" in shown
    assert "air_magic/" not in shown  # air_magic's own frames are not what the user needs
    assert ip.run_cell("1 + 1").result == 2


def test_magics_and_shell_escapes_in_the_cell_fail_clearly(ip):
    with pytest.raises(UsageError, match=r"line 2: !ls"):
        cell(ip, "-n 2", "x = 1\n!ls\n")
    with pytest.raises(UsageError, match=r"line 1: %time"):
        cell(ip, "-n 2", "%time y = 2\n")


def test_syntax_errors_fail_before_launch(ip):
    before = air_magic.last_run()
    with pytest.raises(SyntaxError):
        cell(ip, "-n 2", "def broken(:\n")
    assert air_magic.last_run() is before


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("--timeout soon", "--timeout: takes seconds"),
        ("--timeout 0", "timeout must be"),
        ("-n 0", "num_accelerators"),
        ("--accelerator-type GPU_8xH100", None),
        ("--display fancy", None),
    ],
)
def test_misuse_raises_usage_error(ip, line, match):
    error = UsageError if match else (UsageError, air_magic.AcceleratorError)
    with pytest.raises(error, match=match):
        cell(ip, line, "1\n")


def test_timeout_none_and_a_real_timeout(ip):
    result, _ = cell(ip, "-n 2 --display none --timeout none", "7\n")
    assert result == [7, 7]
    with pytest.raises(air_magic.DistributedTimeoutError):
        cell(ip, "-n 2 --display none --timeout 2", "import time\ntime.sleep(60)\n")


def test_line_magic_status_logs_and_settings(ip):
    cell(ip, "-n 2 --display none", "print('logged line')\n")
    with capture_output() as captured:
        ip.run_line_magic("distributed", "status")
        ip.run_line_magic("distributed", "logs")
        ip.run_line_magic("distributed", "logs 1")
        ip.run_line_magic("distributed", "settings")
    out = captured.stdout
    assert "succeeded" in out and "rank 1: succeeded" in out
    assert air_magic.last_run().log_dir in out
    assert "logged line" in out
    assert "no NVIDIA GPU" in out
    with pytest.raises(UsageError, match="unknown command"):
        ip.run_line_magic("distributed", "frobnicate")


def test_ipythons_own_names_are_skipped_and_reported(ip):
    _, captured = cell(ip, "-n 2 --display none", "def later():\n    return In\n1\n")
    assert "not sent (IPython's own): In" in captured.stdout


def test_augmented_assignment_and_del_work_on_notebook_names(ip):
    ip.run_cell("counter = 1\nacc = 0\ndoomed = 'bye'\nkept_in_notebook = 3")
    result, captured = cell(
        ip,
        "-n 2 --display none",
        "counter += 1\nfor i in range(4):\n    acc += i\ndel doomed\ncounter + acc\n",
    )
    assert result == [8, 8]
    assert ip.user_ns["counter"] == 2 and ip.user_ns["acc"] == 6
    assert "doomed" not in ip.user_ns and ip.user_ns["kept_in_notebook"] == 3
    assert "deleted: doomed" in captured.stdout


def test_in_place_changes_to_sent_objects_come_back_and_unchanged_ones_stay(ip):
    ip.run_cell("history = [1]\nconfig = {'lr': 0.1}\nrank_seen = {}")
    config = ip.user_ns["config"]
    _, captured = cell(
        ip,
        "-n 2 --display none",
        "import os\nhistory.append(2)\nrank_seen[os.environ['RANK']] = config['lr']\n",
    )
    assert ip.user_ns["history"] == [1, 2]
    assert ip.user_ns["rank_seen"] == {"0": 0.1}  # rank 0's version, as for assigned names
    assert ip.user_ns["config"] is config  # read only: the notebook's own object stays
    said = "brought back from rank 0: history (changed in place), rank_seen (changed in place)"
    assert said in captured.stdout


def test_star_imports_come_back(ip):
    import string

    for name in ("ascii_letters", "capwords", "Template"):
        ip.user_ns.pop(name, None)
    cell(ip, "-n 2 --display none", "from string import *\n")
    assert ip.user_ns["ascii_letters"] == string.ascii_letters
    assert ip.user_ns["capwords"] is string.capwords and ip.user_ns["Template"] is string.Template


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        ("return 5", "'return' outside function"),
        ("yield 5", "'yield' outside function"),
        ("await something()", "'await' outside function"),
        ("nonlocal z", "nonlocal declaration not allowed at module level"),
    ],
)
def test_statements_only_valid_in_functions_fail_before_launch(ip, statement, message):
    before = air_magic.last_run()
    with pytest.raises(SyntaxError, match=message) as raised:
        cell(ip, "-n 2", f"a = 1\n{statement}\nb = 2\n")
    assert raised.value.lineno == 2
    assert raised.value.filename.startswith("<ipython-input-") or "distributed-cell" in raised.value.filename
    assert air_magic.last_run() is before


def test_the_cell_compiles_without_air_magics_future_flags(ip):
    # cell_runner.py has `from __future__ import annotations`; the cell must not inherit it.
    result, _ = cell(
        ip, "-n 2 --display none", "def typed(x: int):\n    pass\ntyped.__annotations__['x'] is int\n"
    )
    assert result == [True, True]


def test_ipythons_own_builtins_like_open_are_left_to_the_ranks_silently(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("hi")
    assert "open" in ip.user_ns_hidden  # IPython's own open, in every kernel
    values, captured = cell(ip, "-n 2 --display none", "len(open('x.txt').read())\n")
    assert values == [2, 2]
    assert "not sent" not in captured.stdout, captured.stdout


def test_pull_of_a_name_the_ranks_do_not_have_is_said(ip):
    _, captured = cell(ip, "-n 2 --display none --pull made,nothere", "made = 1\n")
    assert ip.user_ns["made"] == 1
    assert "--pull nothere: rank 0 has no such name after the cell" in captured.stdout, captured.stdout
