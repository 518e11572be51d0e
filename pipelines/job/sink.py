"""The write stage: a Ray Data Datasink that turns processed rows into the output files and
returns exact counts to the driver.

Each write task writes its rows as groups of at most --rows-per-file rows, each group one
set of files sharing a name (the stem): rejects/, sft/ and scores/ first, data/ last. The data/ file commits the group: the next run deletes any sft/ or
scores/ file whose data/ partner is missing (the remains of a crashed run) and treats the ids
in data/ as done. Rejects need no partner: a run skips writing a reject that rejects/ already
holds. Every file appears whole (written under a temporary name, then moved), and the stem is
a hash of the rows in the group, so a retried write task rewrites the same files instead of
adding a second copy.

The error budget (--max-error-share, budget.py) is counted here too: each write task reports
the rows of its group that failed (reasons.FAILURE_REASONS) to a tally the driver holds, and
the task that takes the failures past the budget fails the run, so that a broken model stops
a long run early instead of at its end."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import ray
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink

from mist_core.data.formats import (REJECT_SCHEMA, SCORES_SCHEMA, budget_label, data_rows,
                                    data_schema, sft_records)
from mist_core.reasons import FAILURE_REASONS

from ..common import storage
from .budget import ErrorBudget
from .config import JobConfig
from ..common.errors import ErrorBudgetExceeded
from .stages import OK, REJECT, SKIP

DIRS = ("data", "sft", "scores", "rejects")


def reject_key(source: str, row: int, raw: str | None) -> str:
    """A rejected input row's identity: where it was and what it said."""
    blob = json.dumps([source, row, raw], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


@dataclass
class WriteStats:
    rows: int = 0
    scored: int = 0
    rejected: int = 0
    skipped: int = 0
    rejects_written: int = 0
    sft: int = 0
    score_rows: int = 0
    tokens: int = 0
    score_s: float = 0.0
    written: Counter = field(default_factory=Counter)  # budget label -> data rows
    reasons: Counter = field(default_factory=Counter)
    files: int = 0
    # the first row rejected for a FAILURE_REASONS reason: reason, detail, source, row, id
    first_failure: dict | None = None

    @property
    def failures(self) -> int:
        """Rows rejected because the job or the model failed on them (not bad input)."""
        return sum(self.reasons[r] for r in FAILURE_REASONS)

    def add(self, other: "WriteStats") -> None:
        for name in ("rows", "scored", "rejected", "skipped", "rejects_written", "sft",
                     "score_rows", "tokens", "score_s", "files"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.written.update(other.written)
        self.reasons.update(other.reasons)
        self.first_failure = self.first_failure or other.first_failure


class OutputSink(Datasink):
    def __init__(self, cfg: JobConfig, *, fs, root: str, run_id: str, model: str,
                 extras: pa.Schema, known_rejects: frozenset, budget: ErrorBudget | None = None,
                 tally=None):
        """Settings: cfg's method, budgets, sft_format, sft_mix, seed, scores, rows_per_file.
        `model`: the model's name as the rows record it; `extras`: the extra columns' types
        (the plan's); `known_rejects`: already in rejects/ from an earlier run."""
        self.fs, self.root, self.run_id = fs, root, run_id
        self.method, self.model, self.budgets = cfg.method, model, cfg.budgets
        self.extras, self.schema = extras, data_schema(extras)
        self.sft_format, self.sft_mix, self.seed = cfg.sft_format, cfg.sft_mix, cfg.seed
        self.with_scores = cfg.scores
        self.known_rejects = known_rejects
        self.rows_per_file = cfg.rows_per_file
        self.budget, self.tally = budget, tally  # tally: an ErrorTally actor, or None
        self.stats = WriteStats()

    @property
    def min_rows_per_write(self) -> int:
        return self.rows_per_file  # input rows per file group

    @storage.retried
    def on_write_start(self, schema=None) -> None:
        for d in DIRS if self.with_scores else tuple(d for d in DIRS if d != "scores"):
            self.fs.create_dir(storage.join(self.root, d), recursive=True)

    def write(self, blocks, ctx) -> WriteStats:
        """Write the rows Ray Data hands this task as groups of at most rows_per_file input
        rows each: Ray bundles whole blocks, at least min_rows_per_write rows but often more
        (a scoring call's 256), and the group is what a crash redoes."""
        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        tables = [t for t in tables if t.num_rows]
        stats = WriteStats()
        if not tables:
            return stats
        # In input order, so that a retried task cuts the same groups (the same file names).
        rows = sorted(pa.concat_tables(tables).to_pylist(),
                      key=lambda r: (r["input"], r["source"], r["row"]))
        for i in range(0, len(rows), self.rows_per_file):
            stats.add(self._write_group(rows[i:i + self.rows_per_file]))
        return stats

    def _write_group(self, rows: list[dict]) -> WriteStats:
        stats = WriteStats()
        where = [(r["input"], r["source"], r["row"]) for r in rows]
        digest = hashlib.sha256(json.dumps(where).encode("utf-8")).hexdigest()[:16]
        stem = f"{self.run_id}-{digest}"

        data, sft, scores, rejects = [], [], [], []
        for r in rows:
            stats.rows += 1
            if r["status"] == SKIP:
                stats.skipped += 1
            elif r["status"] == REJECT:
                stats.rejected += 1
                stats.reasons[r["reason"]] += 1
                if r["reason"] in FAILURE_REASONS and stats.first_failure is None:
                    stats.first_failure = {k: r.get(k) for k in ("reason", "detail", "source",
                                                                 "row", "id")}
                if reject_key(r["source"], r["row"], r["raw"]) not in self.known_rejects:
                    rejects.append({k: r.get(k) for k in REJECT_SCHEMA.names} | {"run_id": self.run_id})
            elif r["status"] == OK:
                self._scored(r, stats, data, sft, scores)
            else:
                raise RuntimeError(f"unknown row status {r['status']!r}")

        def w(sub: str, ext: str, payload) -> None:
            storage.write_atomic(self.fs, storage.join(self.root, sub, f"{stem}.{ext}"), payload)

        if rejects:
            w("rejects", "parquet", pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA))
            stats.rejects_written = len(rejects)
        if sft:
            w("sft", "jsonl", "".join(json.dumps(s, ensure_ascii=False) + "\n"
                                      for s in sft).encode("utf-8"))
        if scores:
            w("scores", "parquet", pa.Table.from_pylist(scores, schema=SCORES_SCHEMA))
        if data:  # last: it commits the group's sft/ and scores/ files
            w("data", "parquet", pa.Table.from_pylist(data, schema=self.schema))
        stats.files = bool(data) + bool(rejects) + bool(sft) + bool(scores)
        if stats.failures and self.tally is not None:  # after the files: the group is whole
            _, failed = ray.get(self.tally.add.remote(stem, stats.rows, stats.failures,
                                                      stats.first_failure))
            if self.budget.exceeded(failed):  # the driver says why, in one line
                raise ErrorBudgetExceeded(f"{failed} rows failed, {self.budget.allowed} may "
                                          "(--max-error-share): stopping the run")
        return stats

    def _scored(self, r: dict, stats: WriteStats, data: list, sft: list, scores: list) -> None:
        stats.scored += 1
        stats.tokens += r["n_tokens"] or 0
        stats.score_s += r["score_s"] or 0.0
        extras = json.loads(r["extra"]) if r["extra"] else {}
        rows = data_rows(id=r["id"], question=r["question"], cot=r["cot"], answer=r["answer"],
                         budgets=self.budgets, compressed=r["compressed"],
                         kept_tokens=r["kept_tokens"], cot_tokens=r["chain_len"],
                         method=self.method, model=self.model, extras=extras,
                         extras_schema=self.extras)
        data += rows
        stats.written.update(budget_label(d["budget"]) for d in rows)
        recs = sft_records(id=r["id"], question=r["question"], cot=r["cot"], answer=r["answer"],
                           compressed=dict(zip(self.budgets, r["compressed"])),
                           fmt=self.sft_format, mix=self.sft_mix, seed=self.seed)
        sft += recs
        stats.sft += len(recs)
        if self.with_scores:
            start, n = r["chain_start"], r["chain_len"]
            scores.append({"id": r["id"], "method": self.method, "model": self.model,
                           "token_ids": r["source_ids"][start:start + n], "tokens": r["tokens"],
                           "necessity": r["necessity"], "sufficiency": r["sufficiency"],
                           "facts_necessity": r["facts_necessity"], "scores": r["scores"]})
            stats.score_rows += 1

    def on_write_complete(self, write_result) -> None:
        total = WriteStats()
        for s in write_result.write_returns:
            total.add(s)
        self.stats = total
