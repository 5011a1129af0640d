"""Synthetic ranks through the real caller: how the caller keeps up with 1,000 ranks (issue 34, item 3).

A machine of 2 or 16 cores cannot run 1,000 real ranks; the caller's side of such a call can
still run for real. Here a fake backend (:class:`SyntheticBackend`, plugged in through
``calls.call.prepare_call(..., backend=...)``) has a few generator processes stand in for the
ranks: each plays many ranks at a set rate -- lines on stdout, a tqdm-style bar redrawn on
stderr, bursts, per-step metrics written to each rank's metric file exactly as a real rank's
``mlflow.log_metric`` does (worker/metrics.py), a failure at a chosen rank, a lost node -- and
sends what its ranks print as node facts (``protocol/node_events.py``), the way a Ray node's
agent batches them. Everything after that is the product's own code: the call loop, the outcome
ledger, the output router and its logs, the display (the widget view, its messages counted by a
counting comm; or the text display), the tracked run's metric writer into the embedded MLflow
store, the run's history.

Measured per run: the caller's CPU (this process, every thread; not the generators), its peak
and final RSS, events per second, latency from a rank's write to the display's handling of it
(p50, p99, max: each line carries the generator's ``time.monotonic()``, one clock on Linux),
bytes the widgets sent toward the browser per second, metric rows stored per second (and all of
them in the store at the end).

    python benchmarks/synthetic_ranks.py --ranks 1000 --seconds 20      (one run, JSON out)
    python benchmarks/scale.py --synthetic --ranks 8 64 256 1000        (the table)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import resource
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from air_magic.backends.call_loop import CallLoop
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest
from air_magic.launch.settings import LaunchSettings
from air_magic.protocol import env_names, serialization, wire
from air_magic.protocol.events import Event, EventBus, RankOutput, RecordLink, RunFinished
from air_magic.protocol.node_events import Exited, NodeLost, Output, Raised
from air_magic.protocol.wire import ErrorRecord

FRAME = struct.Struct("<BII")  # kind, rank (or node), payload length
STDOUT, STDERR, DONE, FAIL, LOST = range(5)
TICK_S = 0.1  # a generator's step: each of its ranks prints and logs what is due, then it sleeps


@dataclass
class Scenario:
    ranks: int = 200
    per_node: int = 8
    seconds: float = 10.0
    lines_per_s: float = 10.0  # per rank, on stdout
    metrics_per_s: float = 10.0  # per rank
    bar_per_s: float = 2.0  # redraws of each rank's tqdm-style bar on stderr
    burst_every_s: float = 5.0  # one rank at a time prints a burst of lines this often (0: none)
    burst_lines: int = 2000
    fail_rank: int | None = None  # this rank raises at fail_at seconds
    fail_at: float = 5.0
    lose_node: int | None = None  # this node is lost at lose_at seconds
    lose_at: float = 5.0
    generators: int = 2  # processes playing the ranks

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.per_node)

    def ranks_per_node(self) -> list[int]:
        return [min(self.per_node, self.ranks - n * self.per_node) for n in range(self.nodes)]


# -- the generator: a process playing many ranks ----------------------------------------------


def generate(scenario: Scenario, first: int, last: int, metrics_dir: str | None) -> None:
    """Play ranks ``first`` to ``last - 1``: frames on stdout until ``seconds`` pass (or SIGTERM)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    out = sys.stdout.buffer
    ranks = range(first, last)
    metric_files = {}
    if metrics_dir:
        for r in ranks:
            metric_files[r] = open(wire.metrics_path(metrics_dir, r), "ab", buffering=0)  # noqa: SIM115
    gone: set[int] = set()
    start = time.monotonic()
    step = 0
    line_debt = metric_debt = bar_debt = 0.0
    next_burst = scenario.burst_every_s or float("inf")
    bursts = 0
    lost_said = False
    while True:
        now = time.monotonic()
        elapsed = now - start
        frames: list[bytes] = []
        if elapsed >= scenario.seconds:
            for r in ranks:
                if r not in gone:
                    frames.append(FRAME.pack(DONE, r, 0))
            out.write(b"".join(frames))
            out.flush()
            return
        line_debt += scenario.lines_per_s * TICK_S
        metric_debt += scenario.metrics_per_s * TICK_S
        bar_debt += scenario.bar_per_s * TICK_S
        lines, metrics, bar = int(line_debt), int(metric_debt), bar_debt >= 1
        line_debt -= lines
        metric_debt -= metrics
        if bar:
            bar_debt -= 1
        burst_rank = None
        if elapsed >= next_burst:
            next_burst += scenario.burst_every_s
            burst_rank = (bursts * 37) % scenario.ranks
            bursts += 1
        stamp = f"@t={now:.6f}"
        for r in ranks:
            if r in gone:
                continue
            if scenario.fail_rank == r and elapsed >= scenario.fail_at:
                message = f"rank {r} hit a bad batch".encode()
                text = b"\nTraceback (most recent call last):\nValueError: a bad batch\n"  # after its bar
                frames.append(FRAME.pack(STDERR, r, len(text)) + text)
                frames.append(FRAME.pack(FAIL, r, len(message)) + message)
                gone.add(r)
                continue
            node = r // scenario.per_node
            if scenario.lose_node == node and elapsed >= scenario.lose_at:
                if not lost_said:
                    lost_said = True
                    frames.append(FRAME.pack(LOST, node, 0))
                gone.add(r)
                continue
            text = "".join(
                f"rank {r} step {step + i} loss {1.0 / (step + i + 1):.5f} {stamp}\n" for i in range(lines)
            )
            if burst_rank == r:
                text += "".join(f"rank {r} burst line {i} {stamp}\n" for i in range(scenario.burst_lines))
            if text:
                data = text.encode()
                frames.append(FRAME.pack(STDOUT, r, len(data)) + data)
            if bar:
                pct = min(100, int(100 * elapsed / scenario.seconds))
                fill = pct // 10
                bar_text = f"{'#' * fill}{' ' * (10 - fill)}"
                data = f"\rtrain: {pct:3d}%|{bar_text}| {step}/{step + 100} {stamp}".encode()
                frames.append(FRAME.pack(STDERR, r, len(data)) + data)
            if metrics and r in metric_files:
                ms = int(time.time() * 1000)
                # Each rank's own value: MLflow keeps one row of equal (key, step, time, value).
                rows = "".join(
                    wire.metric_line("loss", 1.0 / (step + i + 1) + r * 1e-9, ms, step + i)
                    for i in range(metrics)
                )
                metric_files[r].write(rows.encode())
        step += max(lines, 1)
        out.write(b"".join(frames))
        out.flush()
        time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))


# -- the fake backend --------------------------------------------------------------------------


class SyntheticCall(CallLoop):
    """A call whose ranks are played by generator processes; the rest is the product's call loop."""

    def __init__(self, request: LaunchRequest, bus: EventBus, scenario: Scenario, stop: StopRequest):
        self.scenario = scenario
        counts = scenario.ranks_per_node()
        super().__init__(
            request,
            bus,
            stop_requested=stop,
            ranks_per_node=counts,
            node_names=[f"node {i}" for i in range(len(counts))],
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[int, bytearray] = {}
        self.generators: dict[int, tuple[subprocess.Popen[bytes], int, int]] = {}  # fd: its ranks
        self.failure_seen: float | None = None  # when the first failure's fact reached the caller
        self.rows_written: int | None = None
        self.counting_s = self.counting_cpu_s = 0.0  # the harness's own counting, not the caller's

    def start(self) -> bool:
        s = self.scenario
        metrics_dir = self.request.env.get(env_names.METRICS_DIR, "")
        bounds = [s.ranks * g // s.generators for g in range(s.generators + 1)]
        for g in range(s.generators):
            spec = json.dumps(dataclasses.asdict(s))
            proc = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--generate",
                    spec,
                    str(bounds[g]),
                    str(bounds[g + 1]),
                    metrics_dir,
                ],
                stdout=subprocess.PIPE,
            )
            self.procs.append(proc)
            assert proc.stdout is not None
            os.set_blocking(proc.stdout.fileno(), False)
            self.buffers[proc.stdout.fileno()] = bytearray()
            self.generators[proc.stdout.fileno()] = (proc, bounds[g], bounds[g + 1])
            self.selector.register(proc.stdout.fileno(), selectors.EVENT_READ)
            for rank in range(bounds[g], bounds[g + 1]):
                self.ledger.started(rank, proc.pid)
        return True

    def pump(self, wait_s: float) -> None:
        for key, _ in self.selector.select(wait_s):
            fd = key.fd
            try:
                data = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not data:  # the generator ended: any rank it had not ended went with it
                self.selector.unregister(fd)
                self._generator_gone(fd)
                continue
            buffer = self.buffers[fd]
            buffer += data
            self._frames(buffer)

    def _generator_gone(self, fd: int) -> None:
        proc, first, last = self.generators[fd]
        code = proc.wait()
        for rank in range(first, last):
            record = self.ledger.records[rank]
            if not record.exited:
                self.ledger.take(record.node, _exited(rank, code if code != 0 else -signal.SIGKILL))

    def _frames(self, buffer: bytearray) -> None:
        at = 0
        view = memoryview(buffer)
        while len(buffer) - at >= FRAME.size:
            kind, who, length = FRAME.unpack_from(buffer, at)
            end = at + FRAME.size + length
            if end > len(buffer):
                break
            payload = bytes(view[at + FRAME.size : end])
            at = end
            self._fact(kind, who, payload)
        view.release()
        del buffer[:at]

    def _fact(self, kind: int, who: int, payload: bytes) -> None:
        node = who // self.scenario.per_node
        if kind in (STDOUT, STDERR):
            self.ledger.take(node, Output(who, "stdout" if kind == STDOUT else "stderr", payload))
        elif kind == DONE:
            value = serialization.dumps(who)
            self.ledger.take(node, _exited(who, 0, result=value))
        elif kind == FAIL:
            error = ErrorRecord(
                rank=who,
                time=time.monotonic(),
                stage="run",
                type_name="builtins.ValueError",
                message=payload.decode(),
                traceback=f"Traceback (most recent call last):\nValueError: {payload.decode()}\n",
                exception=None,
            )
            record = serialization.dumps(error)
            self.failure_seen = self.failure_seen or time.monotonic()
            self.ledger.take(node, Raised(who, record))
            self.ledger.take(node, _exited(who, 1, error=record))
        elif kind == LOST:
            self.failure_seen = self.failure_seen or time.monotonic()
            self.ledger.take(who, NodeLost("its raylet died (synthetic)"))

    def stop(self, grace_s: float, signum: int = signal.SIGTERM) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        if self.ledger.all_exited():
            return
        self.ledger.begin_teardown()
        now = time.monotonic()
        for r in self.ledger.records:
            if not r.exited:
                self.ledger.take(
                    r.node, _exited(r.rank, -signum, teardown_at=now, sigkill_from=now + grace_s)
                )

    def stacks(self) -> dict[int, str]:
        return {}

    def finish(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.selector.close()
        # What the ranks wrote, to compare with the store: counted here, before the tracked run
        # removes the folder, and taken out of the call's measured times (wall and CPU).
        wall, cpu = time.monotonic(), _cpu()
        self.rows_written = _rows_written(self.request.env.get(env_names.METRICS_DIR))
        self.counting_s, self.counting_cpu_s = time.monotonic() - wall, _cpu() - cpu
        SyntheticBackend.last_call = self


def _exited(rank: int, code: int, **kw: object) -> Exited:
    fields: dict[str, object] = {
        "result": None,
        "returned": False,
        "error": None,
        "status_lost": False,
        "teardown_at": None,
        **kw,
    }
    fields["returned"] = fields["result"] is not None
    return Exited(rank, code, time.monotonic(), **fields)  # type: ignore[arg-type]


class SyntheticBackend:
    """The backend seam (``backends/base.py``) over :class:`SyntheticCall`."""

    name = "synthetic"
    last_call: SyntheticCall | None = None

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self._stop = StopRequest()

    def prepare(self, settings: LaunchSettings) -> AcceleratorPlan:
        return AcceleratorPlan(world_size=self.scenario.ranks, gpus=(), detected="synthetic ranks")

    def run(self, request: LaunchRequest, bus: EventBus) -> RunResult:
        return SyntheticCall(request, bus, self.scenario, self._stop).execute()

    def stop(self, grace_s: float | None = None, signum: int | None = None) -> None:
        self._stop.ask(grace_s, signum)

    def stacks(self) -> dict[int, str]:
        return {}


# -- what is measured --------------------------------------------------------------------------


class Probe:
    """A consumer after the display (the tracked run's comes later): counts events and the latency
    from a rank's write (its stamp) to here, after the display handled the event."""

    def __init__(self) -> None:
        self.events = 0  # from the first rank output on
        self.lines = 0
        self.latencies: list[float] = []
        self.first: float | None = None  # the first rank output: the steady part starts
        self.last = 0.0
        self.cpu_first = self.cpu_last = 0.0
        self.sent_first = self.sent_last = 0
        self.messages_first = self.messages_last = 0
        self.finished: RunFinished | None = None
        self.record: RecordLink | None = None  # the tracked run (its first event)

    def handle(self, event: Event) -> None:
        now = time.monotonic()
        if isinstance(event, RecordLink):
            self.record = event
        elif isinstance(event, RankOutput):
            if self.first is None:
                self.first, self.cpu_first, self.sent_first = now, _cpu(), CountingComm.sent_bytes
                self.messages_first = CountingComm.messages
            self.events += 1
            self.lines += event.text.count("\n")
            self.last = now
            at = event.text.find("@t=")
            if at >= 0:
                end = event.text.find("\n", at)
                self.latencies.append(now - float(event.text[at + 3 : end if end >= 0 else None]))
        elif self.first is not None:
            self.events += 1
            if isinstance(event, RunFinished):
                self.last, self.cpu_last, self.sent_last = now, _cpu(), CountingComm.sent_bytes
                self.messages_last = CountingComm.messages
                self.finished = event


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CountingHandle:
    """What ``IPython.display.display(..., display_id=True)`` returns, counting what it would send."""

    def __init__(self, bundle: object) -> None:
        self.update(bundle)

    def update(self, bundle: object, **kwargs: object) -> None:
        CountingComm.messages += 1
        CountingComm.sent_bytes += len(json.dumps(bundle, default=str))


class CountingComm:
    """A widget comm that sends nothing and counts the bytes each message would put on the wire."""

    sent_bytes = 0
    messages = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.comm_id = os.urandom(8).hex()
        self.kernel = True  # ipywidgets sends only through a comm with a kernel
        self._closed = False
        data = kwargs.get("data")
        self._count(data)

    def _count(self, data: object) -> None:
        CountingComm.messages += 1
        CountingComm.sent_bytes += len(json.dumps(data, default=str)) if data is not None else 0

    def send(self, data: object = None, metadata: object = None, buffers: object = None) -> None:
        self._count(data)

    def open(self, *args: object, **kwargs: object) -> None:
        pass

    def close(self, *args: object, **kwargs: object) -> None:
        self._closed = True

    def on_msg(self, callback: object) -> None:
        pass

    def on_close(self, callback: object) -> None:
        pass


def run_scenario(
    scenario: Scenario, display: str = "tabs", tracking: bool = True, count_bytes: bool = True
) -> dict[str, object]:
    """One synthetic call through the real caller; what it cost. ``count_bytes=False`` in a real
    kernel: the widgets go to the page (a browser shows the view of 1,000 ranks)."""
    import comm
    import psutil

    from air_magic.calls.call import prepare_call
    from air_magic.launch.settings import make_settings

    if display == "tabs" and count_bytes:
        import IPython.display

        comm.create_comm = CountingComm  # ipywidgets 8 makes every comm through this
        IPython.display.display = lambda bundle, **kw: CountingHandle(bundle)  # no shell: a count
    CountingComm.sent_bytes = CountingComm.messages = 0

    def synthetic() -> None:  # the payload: never run (no rank unpickles it here)
        return None

    settings = make_settings(display=display, tracking=tracking, experiment=f"synthetic-{scenario.ranks}")
    prepared = prepare_call(
        "synthetic",
        synthetic,
        inspect.signature(synthetic).bind(),
        settings,
        backend=SyntheticBackend(scenario),
    )
    displays = prepared.displays()
    probe = Probe()
    before = resource.getrusage(resource.RUSAGE_SELF)
    sent_before = CountingComm.sent_bytes
    start = time.monotonic()
    result = prepared.run(displays, [probe])
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    call = SyntheticBackend.last_call
    counting_s = call.counting_s if call is not None else 0.0
    counting_cpu_s = call.counting_cpu_s if call is not None else 0.0
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime - counting_cpu_s
    steady_s = max(probe.last - (probe.first or probe.last) - counting_s, 1e-9)
    steady_cpu = probe.cpu_last - probe.cpu_first - counting_cpu_s
    lat = sorted(probe.latencies) or [0.0]
    stored = None
    if tracking and probe.record is not None:
        stored = _rows_in_store(probe.record.run_id)
    written = call.rows_written if call is not None else None
    view = displays[0]._view if displays and hasattr(displays[0], "_view") else None
    return {
        "ranks": scenario.ranks,
        "nodes": scenario.nodes,
        "display": display,
        "outcome": str(result.outcome),
        "root_cause": probe.finished.failed_rank if probe.finished else None,
        "error": None if result.error is None else str(result.error)[:400],
        "log_dir": result.log_dir,
        "tabs_hold": list(getattr(view, "slots", [])),
        # From the failure's fact reaching the caller to the call's end, its root cause named and
        # every other rank stopped (the synthetic ranks stop at once: the loop's share of it).
        "failure_to_end_s": (
            round(probe.last - call.failure_seen - counting_s, 3)
            if call is not None and call.failure_seen
            else None
        ),
        "wall_s": round(wall - counting_s, 2),
        "caller_cpu_s": round(cpu, 2),
        # From the first rank output to the end (what the ranks' streams cost, not the call's set-up).
        "steady_s": round(steady_s, 2),
        "steady_caller_cores": round(steady_cpu / steady_s, 3),
        "caller_maxrss_mb": round(after.ru_maxrss / 1024, 1),
        "caller_rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        "events_per_s": round(probe.events / steady_s),
        "lines_per_s": round(probe.lines / steady_s),
        # What one core of the caller takes at this mix: its ceiling, whatever the generators managed.
        "lines_per_caller_cpu_s": round(probe.lines / max(steady_cpu, 1e-9)),
        "latency_ms_p50": round(1000 * lat[len(lat) // 2], 1),
        "latency_ms_p99": round(1000 * lat[int(len(lat) * 0.99)], 1),
        "latency_ms_max": round(1000 * lat[-1], 1),
        # The messages' content (the widget state, the display bundle); each message also carries
        # Jupyter's envelope (headers and signature, about 0.6 KB), counted by the messages.
        "browser_bytes_per_s": round((probe.sent_last - probe.sent_first) / steady_s),
        "browser_messages_per_s": round((probe.messages_last - probe.messages_first) / steady_s, 1),
        "browser_bytes": CountingComm.sent_bytes - sent_before,
        "metric_rows_stored": stored,
        "metric_rows_per_s": round(stored / steady_s) if stored else None,
        "metric_rows_written": written,
    }


def _rows_written(folder: str | None) -> int | None:
    """The rows the ranks wrote to their metric files (None: no folder)."""
    if not folder or not os.path.isdir(folder):
        return None
    rows = 0
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            rows += f.read().count(b"\n")
    return rows


def _rows_in_store(run_id: str) -> int:
    from mlflow.tracking import MlflowClient

    from air_magic import paths

    engine = MlflowClient(paths.embedded_mlflow_uri())._tracking_client.store.engine
    with engine.connect() as connection:
        count = "SELECT COUNT(*) FROM metrics WHERE run_uuid = ? AND key = 'loss'"
        return int(connection.exec_driver_sql(count, (run_id,)).scalar())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--generate":
        spec, first, last, metrics_dir = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        generate(Scenario(**json.loads(spec)), first, last, metrics_dir or None)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Scenario):
        kind = float if f.type in ("float", float) else int
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    parser.add_argument("--display", default="tabs", choices=["tabs", "text", "none"])
    args = vars(parser.parse_args())
    display = args.pop("display")
    os.environ.setdefault(
        "AIR_MAGIC_MLFLOW_DIR", os.path.join(tempfile.mkdtemp(prefix="synthetic-"), "mlflow")
    )
    print(json.dumps(run_scenario(Scenario(**args), display)), flush=True)


if __name__ == "__main__":
    main()
