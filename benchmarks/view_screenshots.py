"""Screenshots of the view of many ranks in a real browser (issue 34, item 4), for docs/.

    python benchmarks/view_screenshots.py --out docs/

JupyterLab on 127.0.0.1 and Debian's chromium, as the browser test drives them
(tests/browser/test_browser.py's helpers). Two notebooks:

- 64 real CPU ranks (``%%distributed -n 64``): each prints and draws a tqdm bar, rank 37 raises;
  one screenshot once the call has ended (``many-ranks-64.png``);
- 1,000 synthetic ranks on 125 nodes through the real caller in the kernel
  (``benchmarks/synthetic_ranks.py``, widgets sent to the page): a screenshot mid-run
  (``many-ranks-1000-live.png``) and one after rank 737 failed (``many-ranks-1000-failed.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "browser"))

REAL = """%%distributed -n 64
import os, time
from tqdm import tqdm
rank = int(os.environ["RANK"])
print(f"hello from rank {rank}")
for _ in tqdm(range(20), desc=f"rank {rank}", ncols=60, mininterval=0):
    time.sleep(0.05)
if rank == 37:
    raise ValueError("rank 37 read a corrupt shard")
time.sleep(120)
"""

SYNTHETIC = f"""import sys
sys.path.insert(0, {HERE!r})
import synthetic_ranks as sr
result = sr.run_scenario(sr.Scenario(ranks=1000, seconds=40, fail_rank=737, fail_at=30), count_bytes=False)
print({{k: result[k] for k in ("outcome", "root_cause", "steady_caller_cores", "caller_rss_mb")}})
"""


@contextlib.contextmanager
def _view(tb: Any, browser: Any, cell: str) -> Iterator[tuple[Any, Any]]:
    """A notebook of ``%load_ext`` and ``cell`` in its own JupyterLab, both cells run; the page
    and the view of many ranks once it is there."""
    with tb._jupyterlab(Path(tempfile.mkdtemp(prefix="view-")), ["%load_ext air_magic", cell]) as url:
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            tb._run_both_cells(page, url)
            run = page.locator(".air-magic-many-ranks")
            run.wait_for(timeout=120_000)
            yield page, run
        finally:
            page.close()


def _shoot(page: Any, run: Any, path: Path, settle_ms: int = 1500) -> None:
    page.wait_for_timeout(settle_ms)
    run.scroll_into_view_if_needed()
    page.screenshot(path=str(path), full_page=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs")
    parser.add_argument("--only", choices=["real", "synthetic"])
    args = parser.parse_args()
    import test_browser as tb

    out = Path(args.out)
    with tb.playwright_api.sync_playwright() as p:
        browser = tb._chromium(p)
        try:
            if args.only in (None, "real"):
                with _view(tb, browser, REAL) as (page, run):
                    run.locator("text=64 ranks: 1 failed, 63 killed").wait_for(timeout=300_000)
                    _shoot(page, run, out / "many-ranks-64.png")
            if args.only in (None, "synthetic"):
                with _view(tb, browser, SYNTHETIC) as (page, run):
                    run.locator("text=1000 ranks on 125 nodes: 1000 running").wait_for(timeout=120_000)
                    time.sleep(8)
                    _shoot(page, run, out / "many-ranks-1000-live.png", settle_ms=0)
                    run.locator("text=1 failed, 999 killed").wait_for(timeout=120_000)
                    page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=60_000)
                    _shoot(page, run, out / "many-ranks-1000-failed.png")
        finally:
            browser.close()
    print(f"screenshots in {out}")


if __name__ == "__main__":
    main()
