"""The decorator in a real IPython shell: functions from cells travel, errors show cell lines."""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")
from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture(scope="module")
def shell():
    return InteractiveShell.instance()


def test_a_cell_defined_function_runs_on_every_rank(shell):
    result = shell.run_cell(
        "from air_magic import distributed\n"
        "factor = 10\n"
        "@distributed(num_accelerators=2, display='none')\n"
        "def work(x):\n"
        "    import os\n"
        "    return factor * x + int(os.environ['RANK'])\n"
        "values = work.distributed(3)\n"
    )
    result.raise_error()
    assert shell.user_ns["values"] == [30, 31]


def test_a_rank_error_in_a_cell_function_shows_the_cell_line(shell):
    shell.run_cell(
        "from air_magic import distributed\n"  # each test stands alone (xdist may run them apart)
        "@distributed(num_accelerators=2, display='none')\n"
        "def broken():\n"
        "    import os\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ZeroDivisionError('cell line shown')\n"
        "    return 1\n"
    ).raise_error()
    result = shell.run_cell("broken.distributed()")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    cause = str(result.error_in_exec.__cause__)
    assert "rank 1 of 2" in cause
    assert "raise ZeroDivisionError('cell line shown')" in cause  # the source line, from the cell
