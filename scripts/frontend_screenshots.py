"""Screenshots for docs/notebook.md's frontends matrix: a notebook as an nbconvert (or GitHub) export
shows it.

Executes a two-cell notebook (``%load_ext air_magic``; a ``%%distributed -n 2``
cell whose rank 1 fails) with nbclient, exports it to HTML without its widget
state (what GitHub, nbviewer and a reopened VS Code notebook have), and renders
that HTML in headless Chromium (Debian's) to ``docs/frontend-nbconvert.png``.
The JupyterLab screenshot comes from tests/browser/test_browser.py (AIR_MAGIC_SCREENSHOT).

python scripts/frontend_screenshots.py [OUT.png]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers.kernel import notebook_client  # noqa: E402

CELLS = [
    "%load_ext air_magic",
    "%%distributed -n 2 --no-tracking\n"
    "import os\n"
    "rank = int(os.environ['RANK'])\n"
    "for step in range(5):\n"
    "    print(f'rank {rank} step {step} loss {1 / (step + 1):.3f}')\n"
    "if rank == 1:\n"
    "    raise ValueError('rank 1 found a bad batch')\n",
]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "frontend-nbconvert.png"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    with tempfile.TemporaryDirectory() as folder:
        client = notebook_client(nb, timeout=180, path=folder)
        client.allow_errors = True
        client.execute()
        nb.metadata.pop("widgets", None)  # as an export without widget state has it
        body, _ = HTMLExporter().from_notebook_node(nb)
        page = Path(folder) / "export.html"
        page.write_text(body)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox"]
            )
            try:
                view = browser.new_page(viewport={"width": 1000, "height": 800})
                view.goto(page.as_uri())
                view.screenshot(path=str(out), full_page=True)
            finally:
                browser.close()
    print(out)


if __name__ == "__main__":
    main()
