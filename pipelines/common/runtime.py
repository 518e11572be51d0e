"""What every Ray entry point (compress, eval, generate, solve, train) shares: starting or
joining Ray, the model actors' pool and GPU share, and the library versions a run records."""
from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import os
import platform
import re
import sys
import threading
from pathlib import Path

import ray

from mist_core.scoring import allocator

from . import faults

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def init_ray(address: str | None = None, actors: tuple[int, int] = (1, 1),
             cpus_per_actor: float = 1.0, verbose: bool = False) -> bool:
    """Join the cluster at `address` (or RAY_ADDRESS, which `ray job submit` sets for the
    job's driver), else start a local Ray for this run: never a cluster left running on
    this machine. Nothing if Ray is already up in this process. Unless `verbose`, Ray's
    own messages below WARNING and the workers' output (model-loading bars, library
    warnings) stay in Ray's session logs, /tmp/ray/session_latest/logs. Returns whether it
    started a local Ray (its workers then stop when this process shuts it down)."""
    if ray.is_initialized():
        return False
    quiet = {} if verbose else {"log_to_driver": False, "logging_level": logging.WARNING}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **quiet)
        return False
    path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    # Logical CPUs: the model actors' share plus one, so that reading, tokenizing and
    # writing can always run (actors holding every CPU would starve them: a hang).
    cpus = max(os.cpu_count() or 1, math.ceil(actors[1] * cpus_per_actor) + 1)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": path,  # workers import this checkout
                                       **faults.forwarded()}}, **quiet)
    return True


class _Drop(logging.Filter):
    """Drops the records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


# Ray Data hands each pool actor a handle to another actor, which Ray's core worker reports
# at ERROR level for every actor it starts, in the driver's log file and on its stderr
# (ray-project/ray#57733): not a failure of the run, so kept off the console.
NATIVE_NOISE = re.compile(rb"core_worker\.cc:\d+: Actor with class name: .* has constructor "
                          rb"arguments in the object store and max_restarts > 0")


@contextlib.contextmanager
def console(verbose: bool = False):
    """A command's console: with `verbose`, everything Ray and Ray Data print; otherwise
    warnings and errors only, no Ray Data progress blocks (the job prints its own
    `[progress]` lines) and none of the known-harmless native ERROR lines above. What is
    kept off the console is in Ray's session logs all the same."""
    if verbose:
        yield
        return
    import ray.data  # noqa: F401  (configures the ray.data loggers, which are changed here)

    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False
    undo = []
    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console":
            undo.append((handler, handler.level))
            handler.setLevel(logging.WARNING)
    drop = _Drop("Progress bars disabled", "Token authentication is enabled for this Ray")
    noisy = [logging.getLogger(n) for n in
             ("ray.data._internal.progress", "ray._private.authentication.authentication_token_setup")]
    for logger in noisy:
        logger.addFilter(drop)
    try:
        with _filtered_stderr(NATIVE_NOISE):
            yield
    finally:
        for logger in noisy:
            logger.removeFilter(drop)
        for handler, level in undo:
            handler.setLevel(level)
        context.enable_progress_bars = bars


@contextlib.contextmanager
def _filtered_stderr(noise: re.Pattern):
    """File descriptor 2 through a pipe that drops the lines matching `noise`: native code
    (Ray's core worker) writes there, out of Python's reach. Python's own sys.stderr is
    untouched; every other line reaches the real stderr."""
    try:
        real = os.dup(2)
    except OSError:  # no stderr at all: nothing to filter
        yield
        return
    read, write = os.pipe()
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                if not noise.search(line):
                    while line:
                        line = line[os.write(real, line):]

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last writer closes: the pump reads to the end
        thread.join(timeout=5)
        if not thread.is_alive():  # else a child process holds the pipe: leave it the fd
            os.close(real)


def actor_pool(actors: tuple[int, int]) -> ray.data.ActorPoolStrategy:
    """A fixed pool (N) or an autoscaling one (MIN,MAX)."""
    lo, hi = actors
    if lo == hi:
        return ray.data.ActorPoolStrategy(size=lo)
    return ray.data.ActorPoolStrategy(min_size=lo, max_size=hi)


def gpus_per_actor(setting: float | None) -> float:
    """--gpus-per-actor, or where unset (auto) one GPU per actor on a cluster with GPUs."""
    if setting is not None:
        return float(setting)
    return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def actor_resources(cpus_per_actor: float, gpus: float) -> dict:
    """A model actor's Ray options: its CPUs and GPUs, and on a CPU the allocator settings
    scoring there wants from the start of the process (mist_core.scoring.allocator.cpu_scoring_env:
    this process's environment wins; Ray merges them into the job's runtime environment).
    The fault variables set here go with them (faults.py), on a Ray this process joined as
    on one it started."""
    env = faults.forwarded() | ({} if gpus > 0 else allocator.cpu_scoring_env())
    options = {"num_cpus": cpus_per_actor}
    if gpus > 0:
        options["num_gpus"] = gpus
    return options | ({"runtime_env": {"env_vars": env}} if env else {})


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("mist-cot", "ray", "torch", "transformers", "pyarrow", "datasets", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out
