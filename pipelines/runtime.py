"""What every Ray entry point (compress, eval, generate, solve, train) shares: starting or
joining Ray, the model actors' pool and GPU share, and the library versions a run records."""
from __future__ import annotations

import importlib.metadata
import math
import os
import platform
from pathlib import Path

import ray

from mist_core import allocator

from .job import faults

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def init_ray(address: str | None = None, actors: tuple[int, int] = (1, 1),
             cpus_per_actor: float = 1.0) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS, which `ray job submit` sets for the
    job's driver), else start a local Ray for this run: never a cluster left running on
    this machine. Nothing if Ray is already up in this process."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    # Logical CPUs: the model actors' share plus one, so that reading, tokenizing and
    # writing can always run (actors holding every CPU would starve them: a hang).
    cpus = max(os.cpu_count() or 1, math.ceil(actors[1] * cpus_per_actor) + 1)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": path,  # workers import this checkout
                                       **faults.forwarded()}})


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
    scoring there wants from the start of the process (mist_core.allocator.cpu_scoring_env:
    this process's environment wins; Ray merges them into the job's runtime environment)."""
    if gpus > 0:
        return {"num_cpus": cpus_per_actor, "num_gpus": gpus}
    return {"num_cpus": cpus_per_actor, "runtime_env": {"env_vars": allocator.cpu_scoring_env()}}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("mist-cot", "ray", "torch", "transformers", "pyarrow", "datasets", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out
