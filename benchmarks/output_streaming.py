"""Output streaming: what printing costs a rank, against the same rank writing to /dev/null.

    python benchmarks/output_streaming.py flood [--ranks 2] [--lines 200000] [--pairs 5]
    python benchmarks/output_streaming.py paced [--ranks 8] [--rate 10000] [--seconds 2] [--rounds 3]

``flood``: ranks print N lines as fast as they can, captured, logged and shown
with the text display (into a buffer), against the same calls writing the lines
to /dev/null inside the rank; pairs interleaved (the order alternating). Reports
medians of the slowest rank's printing loop and of the call's wall time, the
overhead of each, and lines lost (counted in the logs; must be 0).

``paced``: each rank does a fixed amount of work between lines, sized so that
it prints RATE lines a second, and alternates blocks of 0.1 s in one call: the
work with the lines to /dev/null, then with the lines printed (the order
flipping each block); a round is SECONDS of each. The cost is the printed
round's time over the quiet one's, per rank (median of rounds; the median and
the worst rank reported), in wall time and in the rank's CPU time (its threads
included: the flusher's work counts), which other processes' scheduling does
not blur. Both run on warm CPU ranks (gloo), tracking off: the output path is
what is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import time

from air_magic import distributed, last_run
from air_magic.node import warm


def flood(n: int, how: str) -> float:
    import os
    import sys
    import time

    out = open(os.devnull, "w") if how == "devnull" else sys.stdout  # noqa: SIM115
    rank = os.environ["RANK"]
    start = time.perf_counter()
    for i in range(n):
        print(f"rank {rank} line {i} " + "." * 40, file=out)
    out.flush()
    return time.perf_counter() - start


def paced(rate: int, seconds: float, rounds: int) -> list[tuple[float, float]]:
    import os
    import sys
    import time

    def work(k: int) -> int:
        total = 0
        for j in range(k):
            total += j * j
        return total

    # The work per line, sized once on this rank's core so that the quiet round prints at ``rate``.
    probe = 20_000
    start = time.perf_counter()
    work(probe)
    per_line = max(1, int(probe / ((time.perf_counter() - start) * rate)))
    lines = int(rate * seconds)
    devnull = open(os.devnull, "w")  # noqa: SIM115
    rank = os.environ["RANK"]
    # Quiet and printed blocks of 0.1 s alternate (the order flipping each block), so that a
    # machine's drift (frequency, neighbours) falls on both alike; a round sums its blocks.
    block = max(1, rate // 10)
    results = []
    step = 0
    for _ in range(rounds):
        spent = {id(devnull): [0.0, 0.0], id(sys.stdout): [0.0, 0.0]}
        for b in range(max(1, lines // block)):
            for out in (devnull, sys.stdout) if b % 2 == 0 else (sys.stdout, devnull):
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(block):
                    work(per_line)
                    print(f"rank {rank} step {step} loss 0.{step:06d}", file=out)
                    step += 1
                out.flush()
                spent[id(out)][0] += time.perf_counter() - start
                spent[id(out)][1] += time.process_time() - cpu
        results.append((*spent[id(devnull)], *spent[id(sys.stdout)]))
    return results


def _header(command: str) -> None:
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: {os.cpu_count()} cores")
    print(f"# command: python benchmarks/output_streaming.py {command}")


def _quietly(fn, *args):  # type: ignore[no-untyped-def]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn.distributed(*args)


def run_flood(args: argparse.Namespace) -> None:
    fn = distributed(num_accelerators=args.ranks, display="text", tracking=False)(flood)
    _quietly(fn, 1, "devnull")
    warm.get_starter(wait_s=120)
    loop: dict[str, list[float]] = {"devnull": [], "stdout": []}
    wall: dict[str, list[float]] = {"devnull": [], "stdout": []}
    lost = 0
    for pair in range(args.pairs):
        order = ("devnull", "stdout") if pair % 2 == 0 else ("stdout", "devnull")
        for how in order:
            start = time.perf_counter()
            results = _quietly(fn, args.lines, how)
            wall[how].append(time.perf_counter() - start)
            loop[how].append(max(results))
            if how == "stdout":
                info = last_run()
                for rank in range(args.ranks):
                    with open(info.log_path(rank)) as f:
                        lost += args.lines - sum(1 for _ in f)
    q_loop, l_loop = statistics.median(loop["devnull"]), statistics.median(loop["stdout"])
    q_wall, l_wall = statistics.median(wall["devnull"]), statistics.median(wall["stdout"])
    _header(f"flood --ranks {args.ranks} --lines {args.lines} --pairs {args.pairs}")
    print(
        "| ranks x lines | rank's loop, /dev/null (s) | rank's loop, printed (s) | overhead "
        "| call, /dev/null (s) | call, printed (s) | overhead | lines lost |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.ranks} x {args.lines} | {q_loop:.3f} | {l_loop:.3f} | {(l_loop / q_loop - 1) * 100:.0f} % "
        f"| {q_wall:.2f} | {l_wall:.2f} | {(l_wall / q_wall - 1) * 100:.0f} % | {lost} |"
    )


def run_paced(args: argparse.Namespace) -> None:
    fn = distributed(num_accelerators=args.ranks, display="text", tracking=False)(paced)
    _quietly(fn, 10, 0.01, 1)
    warm.get_starter(wait_s=120)
    per_rank = _quietly(fn, args.rate, args.seconds, args.rounds)
    # Per rank, the median over rounds of printed/quiet: wall time, and CPU time (the rank's
    # process, its threads included), which other processes' scheduling does not blur.
    wall = [statistics.median(lw / qw for qw, _, lw, _ in rounds) - 1 for rounds in per_rank]
    cpu = [statistics.median(lc / qc for _, qc, _, lc in rounds) - 1 for rounds in per_rank]
    quiet = statistics.median(r[0] for rounds in per_rank for r in rounds)
    rate = args.rate * args.seconds / quiet
    _header(f"paced --ranks {args.ranks} --rate {args.rate} --seconds {args.seconds} --rounds {args.rounds}")
    print(
        "| ranks | lines/s per rank (quiet round) | wall cost: median rank | worst rank "
        "| CPU cost: median rank | worst rank | lines lost |"
    )
    print("|---|---|---|---|---|---|---|")
    info = last_run()
    block = max(1, args.rate // 10)
    expected = max(1, int(args.rate * args.seconds) // block) * block * args.rounds
    lost = 0
    for rank in range(args.ranks):
        with open(info.log_path(rank)) as f:
            lost += expected - sum(1 for line in f if " step " in line)
    print(
        f"| {args.ranks} | {rate:,.0f} | {statistics.median(wall) * 100:.1f} % | {max(wall) * 100:.1f} % "
        f"| {statistics.median(cpu) * 100:.1f} % | {max(cpu) * 100:.1f} % | {lost} |"
    )
    print("# per rank, each round's printed/quiet ratio, wall (CPU):")
    for rank, rounds in enumerate(per_rank):
        print(f"#   rank {rank}: " + ", ".join(f"{lw / qw:.3f} ({lc / qc:.3f})" for qw, qc, lw, lc in rounds))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("flood")
    f.add_argument("--ranks", type=int, default=2)
    f.add_argument("--lines", type=int, default=200_000)
    f.add_argument("--pairs", type=int, default=5)
    p = sub.add_parser("paced")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rate", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run_flood(args) if args.mode == "flood" else run_paced(args)


if __name__ == "__main__":
    main()
