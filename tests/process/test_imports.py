"""What a fresh interpreter imports, and what it says, when it imports air_magic (one process a test).

Moved out of the unit tier, whose tests start no process: each of these runs ``python -c``.
"""

from __future__ import annotations

import json
import subprocess
import sys


def test_detection_here_finds_no_gpu_and_imports_nothing_heavy():
    code = (
        "import sys; from air_magic.launch.accelerators import detect_gpus; print(detect_gpus());"
        "print(sorted(m for m in ('torch','IPython','ipywidgets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "[]"]


def test_importing_the_package_imports_nothing_heavy():
    heavy = ("torch", "IPython", "ipywidgets", "mlflow")
    code = f"import json, sys, air_magic; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == []


def test_without_ray_the_error_names_the_extra(tmp_path):
    script = (
        "import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
        "from air_magic import distributed\n"
        "try:\n"
        "    distributed(num_accelerators=2, cluster='ray', tracking=False)(print).distributed()\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert 'pip install "air_magic[ray]"' in out.stdout, out.stderr[-2000:]
