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
import os
import sys
import tempfile
import time
from pathlib import Path

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
                tmp = Path(tempfile.mkdtemp(prefix="view-real-"))
                with tb._jupyterlab(tmp, ["%load_ext air_magic", REAL]) as url:
                    page = browser.new_page(viewport={"width": 1280, "height": 1000})
                    tb._run_both_cells(page, url)
                    run = page.locator(".air-magic-many-ranks")
                    run.wait_for(timeout=120_000)
                    run.locator("text=64 ranks: 1 failed, 63 killed").wait_for(timeout=300_000)
                    page.wait_for_timeout(1500)
                    run.scroll_into_view_if_needed()
                    page.screenshot(path=str(out / "many-ranks-64.png"), full_page=True)
                    page.close()
            if args.only in (None, "synthetic"):
                tmp = Path(tempfile.mkdtemp(prefix="view-synthetic-"))
                with tb._jupyterlab(tmp, ["%load_ext air_magic", SYNTHETIC]) as url:
                    page = browser.new_page(viewport={"width": 1280, "height": 1000})
                    tb._run_both_cells(page, url)
                    run = page.locator(".air-magic-many-ranks")
                    run.wait_for(timeout=120_000)
                    run.locator("text=1000 ranks on 125 nodes: 1000 running").wait_for(timeout=120_000)
                    time.sleep(8)
                    run.scroll_into_view_if_needed()
                    page.screenshot(path=str(out / "many-ranks-1000-live.png"), full_page=True)
                    run.locator("text=1 failed, 999 killed").wait_for(timeout=120_000)
                    page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=60_000)
                    page.wait_for_timeout(1500)
                    run.scroll_into_view_if_needed()
                    page.screenshot(path=str(out / "many-ranks-1000-failed.png"), full_page=True)
                    page.close()
        finally:
            browser.close()
    print(f"screenshots in {out}")


if __name__ == "__main__":
    main()
