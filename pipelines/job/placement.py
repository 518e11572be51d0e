"""Where the scoring actors run: the torch device they use (--device), and a record of each
one (its node, the accelerators Ray gave it, the chains it scored) for the manifest's
`actors`.

Ray Data builds the scoring actors (stages.ScoreActor) itself and takes only rows back from
them, so each actor reports its running totals to an ActorStats actor that the driver starts
for the run: one fire-and-forget call after each batch, and during a batch after a forward
pass at most every REPORT_S seconds. The driver prints a progress line from those totals
every --progress-interval seconds (Progress), and reads the records before it writes the
manifest."""
from __future__ import annotations

import logging
import math
import os
import threading
import time

import ray

from .budget import on_driver_node
from ..common.errors import ConfigError

log = logging.getLogger(__name__)
STATS_NAME = "mist-actor-stats-"  # + the run id: the ActorStats actor's name
# A scoring actor reports its totals after each batch, and within a batch after a forward
# pass once this many seconds have passed since its last report.
REPORT_S = 2.0


def resolve_device(device: str, gpus: float) -> str:
    """The scoring actors' torch device, from --device and the GPUs Ray gives each actor.
    auto is cuda on GPU-placed actors, else cpu; cpu stays cpu; cuda needs GPUs."""
    if device == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if device == "cuda" and gpus <= 0:
        raise ConfigError("--device cuda needs a GPU for each scoring actor, but they get none "
                          "(--gpus-per-actor 0, or auto on a cluster without GPUs): give "
                          "--gpus-per-actor 1 on a cluster with GPUs, or --device cpu or auto")
    return device


def here() -> dict:
    """This worker's place: node id and address, and the accelerators Ray assigned to it
    (e.g. {"GPU": ["0"]}; empty for a CPU actor). Outside Ray (a ScoreActor built by hand)
    only the pid: asking for the runtime context would start a local Ray."""
    if not ray.is_initialized():
        return {"actor_id": None, "node_id": None, "node_ip": None, "pid": os.getpid(),
                "accelerator_ids": {}}
    ctx = ray.get_runtime_context()
    ids = {kind: [str(i) for i in found]
           for kind, found in ctx.get_accelerator_ids().items() if found}
    return {"actor_id": ctx.get_actor_id(), "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "accelerator_ids": ids}


class ActorStats:
    """The scoring actors' records, one per actor process, each replaced by the process's
    next report. Ray restarts a lost actor (its node gone) under the same actor id in a new
    process: the lost process's record stays, and the new one gets its own."""

    def __init__(self):
        self.records: dict[tuple, dict] = {}
        self.started: dict[tuple, float] = {}  # when each process began scoring (time.time())

    def report(self, record: dict, started: float | None = None) -> None:
        key = record["actor_id"], record["node_id"], record["pid"]
        self.records[key] = record
        if started is not None:
            self.started.setdefault(key, started)

    def all(self) -> list[dict]:
        return list(self.records.values())  # in the order the actors first reported

    def progress(self) -> dict:
        """For the driver's progress line: chains through scoring so far (scored or
        rejected by the scorer) and of them rejected, over every process (a batch that a
        lost process had scored counts again when it is redone), and when the first of
        them began scoring (time.time(), None before any did)."""
        return {"done": sum(r.get("chains_scored", 0) for r in self.records.values()),
                "rejected": sum(r.get("chains_rejected", 0) for r in self.records.values()),
                "started": min(self.started.values(), default=None)}


def start_stats(run_id: str):
    """The run's ActorStats actor (budget.on_driver_node), named STATS_NAME + run id so
    that a running job's actors can be looked up (ray.get_actor)."""
    return on_driver_node(ActorStats, name=STATS_NAME + run_id)


def report(stats, record: dict, started: float | None = None) -> None:
    """From a scoring actor: send its record (and when it began scoring), without waiting
    and without ever failing the scoring (a lost record only leaves the manifest's `actors`
    short and the progress line behind)."""
    if stats is None:
        return
    try:
        stats.report.remote(record, started)
    except Exception as e:  # noqa: BLE001
        print(f"[score] could not report this actor's totals: {e!r}", flush=True)


def collect(stats) -> list[dict] | None:
    """The driver's read of the records at the end of the run, then the actor is ended.
    None if they cannot be read (the manifest says so rather than the run failing)."""
    if stats is None:
        return []
    try:
        return ray.get(stats.all.remote(), timeout=60)
    except Exception as e:  # noqa: BLE001
        log.warning("could not read the scoring actors' records: %r", e)
        return None
    finally:
        ray.kill(stats, no_restart=True)


def clock(seconds: float) -> str:
    """A duration as m:ss, or h:mm:ss from an hour on."""
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def progress_line(done: int, total: int, rejected: int, started: float | None,
                  now: float) -> str:
    """`[progress] 120/200 chains scored (60%), 3.1 chains/s, ETA 0:26, 2 rejected`: chains
    through scoring (rejected ones included) of the planned total, the rate since the first
    actor began scoring, the time left at that rate, the chains the scorer rejected."""
    done = min(done, total)  # a batch redone after a lost actor counts twice in the records
    pct = 100 * done // total if total else 100
    if started is None:
        return (f"[progress] {done}/{total} chains scored ({pct}%), 0 chains/s, ETA ?, "
                f"{rejected} rejected; the scoring actors are starting (loading the model)")
    rate = done / max(now - started, 1e-3)
    eta = clock((total - done) / rate) if rate > 0 else "?"
    return (f"[progress] {done}/{total} chains scored ({pct}%), {rate:.3g} chains/s, "
            f"ETA {eta}, {rejected} rejected")


class Progress:
    """The driver's progress line while the pipeline runs: a thread that reads the
    ActorStats totals every `interval` seconds and prints progress_line to stdout (flushed:
    `ray job logs -f` shows it as it comes). Off with interval 0, without an ActorStats
    actor (nothing to score) or with nothing planned. A context manager around the run."""

    # The most time between two lines. An unchanged line (the actors still loading the
    # model) is skipped only while the next tick would still come within it, so that a
    # short interval does not repeat it every tick and no interval leaves a longer silence.
    SILENCE = 15.0

    def __init__(self, stats, total: int, interval: float, out=None):
        self.stats, self.total, self.interval = stats, total, interval
        self.out = out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending = None  # a read of the totals not answered yet
        self._last: dict | None = None  # the latest totals read

    def __enter__(self) -> "Progress":
        if self.stats is not None and self.interval > 0 and self.total > 0:
            self._thread = threading.Thread(target=self._run, name="mist-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def read(self) -> dict | None:
        """The latest totals: a fresh read where the ActorStats actor answers within a
        quarter of the interval (at most 2 s), else the last ones (None before any; the
        actor may still be starting), so that a line still comes on time."""
        if self._pending is None:
            self._pending = self.stats.progress.remote()
        ready, _ = ray.wait([self._pending], timeout=min(0.25 * self.interval, 2.0))
        if ready:
            pending, self._pending = self._pending, None
            self._last = ray.get(pending)
        return self._last

    def says_again(self, tick: int, last_tick: int) -> bool:
        """Whether an unchanged line is printed at `tick` (the last line at `last_tick`):
        when waiting for the next tick would leave more than SILENCE without one."""
        return (tick + 1 - last_tick) * self.interval > self.SILENCE

    def _run(self) -> None:
        start, tick, warned = time.monotonic(), 0, False
        last_line, last_tick = None, 0
        while True:
            # A fixed schedule, from the start: a slow read delays one line, not the rest.
            tick = max(tick + 1, math.ceil((time.monotonic() - start) / self.interval))
            if self._stop.wait(max(0.0, start + tick * self.interval - time.monotonic())):
                return
            try:
                totals = self.read() or {"done": 0, "rejected": 0, "started": None}
            except Exception as e:  # noqa: BLE001 -- the line is a convenience, never fatal
                self._pending = None
                if not warned:
                    log.warning("progress: could not read the scoring actors' totals: %r", e)
                    warned = True
                continue
            if self._stop.is_set():
                return
            line = progress_line(totals["done"], self.total, totals["rejected"],
                                 totals["started"], time.time())
            if line == last_line and not self.says_again(tick, last_tick):
                continue
            last_line, last_tick = line, tick
            print(line, file=self.out, flush=True)
