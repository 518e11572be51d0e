"""The error budget of a run (--max-error-share): how many of the rows read may fail for the
job's or the model's fault (reasons.FAILURE_REASONS) before the run fails with exit status 5
and no manifest, and the tally through which the write tasks (sink.py) stop a run early.

Light on purpose (the standard library and ray): the tally actor's process imports this
module alone, not the model code."""
from __future__ import annotations

import math
from dataclasses import dataclass

import ray


@dataclass(frozen=True)
class ErrorBudget:
    """--max-error-share of the rows a run reads (of their examples, where an adapter fans
    a row out): at most ⌊share × rows⌋ of them may fail."""

    share: float
    rows: int

    @property
    def allowed(self) -> int:
        return math.floor(self.share * self.rows + 1e-9)

    def exceeded(self, failures: int) -> bool:
        return failures > self.allowed

    def message(self, failures: int, first: dict | None, seen: int | None = None) -> str:
        """One line: how many failed of how many, the share allowed, the first failure.
        `seen`: rows written when the run stopped, if it stopped before the end."""
        early = seen is not None and seen < self.rows
        text = (f"{failures} of {self.rows} rows failed"
                + (f" (the run stopped after {seen})" if early else "")
                + f", more than --max-error-share {self.share:g} allows ({self.allowed})")
        if first:
            detail = first.get("detail") or ""
            detail = detail if len(detail) <= 300 else detail[:300] + "…"
            from ..common.storage import redact

            where = f"{redact(first.get('source') or '?')} row {first.get('row')}"
            if first.get("id") is not None:
                where += f", id {first['id']}"
            text += f"; first: {first['reason']}: {detail} ({where})"
        text += ("; the run wrote no manifest: fix the cause and rerun the same command, "
                 "which redoes the failed rows")
        return " ".join(text.split())  # one line, whatever the detail holds


class ErrorTally:
    """The rows written and failed so far, per file group, across a run's write tasks: a
    Ray actor the driver starts (start_tally). Keyed by group, so that a write task retried
    by Ray counts once."""

    def __init__(self):
        self.groups: dict[str, tuple[int, int]] = {}
        self.first: dict | None = None

    def add(self, stem: str, rows: int, failures: int, first: dict | None) -> tuple[int, int]:
        self.groups[stem] = (rows, failures)
        self.first = self.first or first
        return self.totals()[:2]

    def totals(self) -> tuple[int, int, dict | None]:
        """(rows written, rows failed, the first failure)."""
        return (sum(r for r, _ in self.groups.values()),
                sum(f for _, f in self.groups.values()), self.first)


def on_driver_node(cls, **options):
    """A 0-CPU actor of `cls` that keeps a run's numbers, on the driver's node, so that
    losing a worker node does not lose them. The affinity is hard: Ray 2.60 placed a
    soft-affine actor on a worker node although the driver's could take it (and a 0-CPU
    actor always fits on the driver's node, which lives as long as the run)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(num_cpus=0, max_restarts=0)(cls).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False), **options).remote()


def start_tally():
    """An ErrorTally actor for this run (on_driver_node)."""
    return on_driver_node(ErrorTally)
