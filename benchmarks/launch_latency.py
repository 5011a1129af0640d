"""Launch latency of a trivial job: air_magic (cold and warm) against torchrun and accelerate, same run.

    python benchmarks/launch_latency.py [--ranks 1 2 4] [--repeats 5] [--plot docs/launch_latency.png]

One sample is the wall time of one whole call: start the ranks, init the
process group, one all_reduce, destroy, collect the results. air_magic runs
end to end as a user gets it: tracking (MLflow, embedded store) and the text
display on. "first" is a process's first call (it imports torch and mlflow in
the caller and starts the warm starter in the background); "cold" starts fresh
interpreters (warm_start=False); "warm" forks from the starter. torchrun is
`python -m torch.distributed.run --standalone`; accelerate's notebook_launcher
(when installed) forks the caller itself, which is why it is fast and why it
breaks once CUDA was touched. Prints a markdown table; --plot writes a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from trivial_job import trivial  # noqa: E402

from air_magic import distributed  # noqa: E402
from air_magic.node import warm  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            fn()
        samples.append(time.perf_counter() - start)
    return samples


def air_magic_calls(ranks: int, repeats: int) -> dict[str, float]:
    cold = distributed(num_accelerators=ranks, display="text", warm_start=False)(trivial)
    warm_fn = distributed(num_accelerators=ranks, display="text")(trivial)
    out = {}
    if ranks == 1 or "first" not in _firsts:
        _firsts["first"] = timed(lambda: warm_fn.distributed(), 1)[0]
    out["first"] = _firsts["first"]
    warm.get_starter(wait_s=120)
    out["cold"] = statistics.median(timed(lambda: cold.distributed(), repeats))
    out["warm"] = statistics.median(timed(lambda: warm_fn.distributed(), repeats))
    return out


_firsts: dict[str, float] = {}


def torchrun(ranks: int, repeats: int) -> float:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", os.path.join(HERE, "trivial_job.py"),
    ]  # fmt: skip
    return statistics.median(
        timed(
            lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            repeats,
        )
    )


def notebook_launcher(ranks: int, repeats: int) -> float | None:
    """accelerate's notebook_launcher, timed in a clean process of its own.

    It forks the calling process. Forking this benchmark's process (which has MLflow's
    and air_magic's threads) deadlocked when tried, the peer failure mode air_magic
    avoids; so it gets a fresh caller that has imported only torch and accelerate.
    """
    if ranks < 2 or importlib.util.find_spec("accelerate") is None or _has_gpu():
        # With one process it runs the function in the caller; with GPUs it forks the caller,
        # which breaks once CUDA is initialised: no comparable number either way.
        return None
    code = (
        "import statistics, sys, time; sys.path.insert(0, sys.argv[1])\n"
        "from trivial_job import trivial\n"
        "from accelerate import notebook_launcher\n"
        "ts = []\n"
        "for _ in range(int(sys.argv[3])):\n"
        "    t = time.perf_counter()\n"
        "    notebook_launcher(trivial, num_processes=int(sys.argv[2]))\n"
        "    ts.append(time.perf_counter() - t)\n"
        "print(statistics.median(ts))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, HERE, str(ranks), str(repeats)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return float(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


def _has_gpu() -> bool:
    from air_magic.launch.accelerators import detect_gpus

    return bool(detect_gpus())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")  # fmt: skip
    print(f"# command: python benchmarks/launch_latency.py {' '.join(sys.argv[1:])}")
    print("| ranks | air_magic first (s) | air_magic cold (s) | air_magic warm (s) | torchrun (s) "
          "| notebook_launcher (s) | torchrun / warm |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = []
    for ranks in args.ranks:
        am = air_magic_calls(ranks, args.repeats)
        tr = torchrun(ranks, args.repeats)
        nl = notebook_launcher(ranks, args.repeats)
        rows.append((ranks, am, tr, nl))
        nl_text = f"{nl:.3f}" if nl is not None else "n/a"
        print(f"| {ranks} | {am['first']:.2f} | {am['cold']:.2f} | {am['warm']:.3f} | {tr:.2f} | {nl_text} "
              f"| {tr / am['warm']:.0f}x |", flush=True)  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [r[0] for r in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, [r[2] for r in rows], "o-", label="torchrun --standalone")
        ax.plot(xs, [r[1]["cold"] for r in rows], "o-", label="air_magic cold")
        ax.plot(xs, [r[1]["warm"] for r in rows], "o-", label="air_magic warm")
        if all(r[3] is not None for r in rows):
            ax.plot(xs, [r[3] for r in rows], "o--", label="accelerate notebook_launcher (forks the caller)")
        ax.set_xlabel("ranks")
        ax.set_ylabel("seconds per call (median)")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_title(f"Trivial distributed job, {platform.node()}, {os.cpu_count()} cores")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()
