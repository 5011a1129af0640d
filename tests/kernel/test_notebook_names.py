"""Classes and functions defined in the notebook pickle inside the ranks, as under torchrun (issue 48 item 1).

In a rank the user's names are attributes of ``sys.modules["__main__"]`` (worker/main_module.py),
for ``%%distributed`` cells, decorated functions and session cells, warm and fresh: ``pickle``,
``torch.save`` of a whole object and a fork ``multiprocessing.Pool`` find them by name.
"""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")
from IPython.utils.capture import capture_output

# Pickles a notebook class and a notebook function by name inside the rank, three ways.
PROBE = """
import multiprocessing, os, pickle, sys, tempfile
import torch

class Box:
    def __init__(self, v):
        self.v = v

def square(x):
    return x * x

path = os.path.join(tempfile.mkdtemp(), 'box.pt')
torch.save(Box(5), path)
with multiprocessing.get_context('fork').Pool(2) as pool:
    squares = pool.map(square, [1, 2, 3])
(pickle.loads(pickle.dumps(Box(int(os.environ['RANK'])))).v,
 torch.load(path, weights_only=False).v, squares, sys.modules['__main__'].Box is Box)
"""


def _cell(ip, line, body):
    with capture_output():
        return ip.run_cell_magic("distributed", line, body)


@pytest.mark.parametrize("start", ["warm", "fresh"])
def test_a_cells_classes_and_functions_pickle_in_the_ranks(ip, start):
    line = "-n 2 --display none --no-tracking" + (" --no-warm-start" if start == "fresh" else "")
    assert _cell(ip, line, PROBE) == [(0, 5, [1, 4, 9], True), (1, 5, [1, 4, 9], True)]


def test_a_decorated_functions_notebook_classes_pickle_in_the_ranks(ip, tmp_path):
    ip.user_ns["out"] = str(tmp_path)
    ip.run_cell(
        "import os, pickle\n"
        "import torch\n"
        "import air_magic\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(2, 1)\n"
        "class Config:\n"  # reaches the rank only as an argument's class
        "    def __init__(self, lr):\n"
        "        self.lr = lr\n"
        "def helper(v):\n"
        "    return v + 1\n"
        "@air_magic.distributed(num_accelerators=2, display='none', tracking=False)\n"
        "def train(config):\n"
        "    rank = int(os.environ['RANK'])\n"
        "    path = os.path.join(out, f'net-{rank}.pt')\n"
        "    torch.save(Net(), path)\n"  # a whole-model checkpoint, as tutorials do
        "    again = pickle.loads(pickle.dumps(config))\n"
        "    return type(torch.load(path, weights_only=False)).__name__, again.lr, "
        "pickle.loads(pickle.dumps(helper))(rank)\n"
        "result = train.distributed(Config(0.5))\n"
    )
    assert ip.user_ns.get("result") == [("Net", 0.5, 1), ("Net", 0.5, 2)], ip.user_ns.get("result")


def test_a_sessions_classes_pickle_in_later_cells_and_calls(ip):
    with capture_output():
        started = ip.run_line_magic("distributed", "session start -n 2 --display none --no-tracking")
    try:
        _cell(ip, "", "class Point:\n    def __init__(self, x):\n        self.x = x\np = Point(3)")
        assert _cell(ip, "", "import pickle\npickle.loads(pickle.dumps(p)).x") == [3, 3]
        ip.run_cell(
            "class Tag:\n    name = 'tag'\n"
            "def use_tag():\n    import pickle\n    return pickle.loads(pickle.dumps(Tag())).name"
        )
        assert started.run(ip.user_ns["use_tag"]) == ["tag", "tag"]
        # The session's own names are not replaced by the call's: its data, nor a function a cell defined.
        assert _cell(ip, "", "p.x") == [3, 3]
        _cell(ip, "", "def helper():\n    return 'the session'")
        ip.run_cell("def helper():\n    return 'the notebook'\ndef use_helper():\n    return helper()")
        assert started.run(ip.user_ns["use_helper"]) == ["the notebook", "the notebook"]
        assert _cell(ip, "", "globals()['helper']()") == ["the session", "the session"]
    finally:
        started.stop(quiet=True)
