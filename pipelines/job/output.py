"""The output folder between runs: what an earlier run left (ids done, rejects recorded,
its manifest), clearing it for --mode overwrite, removing the remains of a crashed run,
and reading it back to check the counts."""
from __future__ import annotations

import json
import posixpath
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mist_core.data.formats import DATA_COLUMNS, LLAMAFACTORY_NAME, budget_label, llamafactory_entry

from ..common import storage
from ..common.errors import ConfigError
from .lease import LEASE
from .sink import DIRS, reject_key

MANIFEST = "_manifest.json"
PREVIOUS = "_manifest.previous.json"  # an earlier manifest while a run is in progress
DATASET_INFO = "dataset_info.json"  # LLaMA-Factory's entry for sft/ (formats.llamafactory_entry)
# A parquet folder with no rows yet holds one empty file of its schema, so that glob reads
# (duckdb 'rejects/*.parquet', polars) find a file and the columns instead of failing.
EMPTY = "empty"
_OURS = set(DIRS) | {MANIFEST, PREVIOUS, DATASET_INFO, LEASE}


@dataclass
class Existing:
    """What the output already holds."""

    done_ids: frozenset = frozenset()
    rejects: frozenset = frozenset()  # reject_key of every row in rejects/
    per_budget: Counter = field(default_factory=Counter)
    methods: set = field(default_factory=set)
    models: set = field(default_factory=set)
    budgets: set = field(default_factory=set)
    manifest: dict | None = None  # the last finished run's
    schema: pa.Schema | None = None  # data/'s, unified over its files
    sft: int = 0
    reject_rows: int = 0
    reject_reasons: Counter = field(default_factory=Counter)  # rows in rejects/ by reason


class Output:
    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.root, self.prefix = storage.filesystem(uri)

    def path(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def display(self, *parts: str) -> str:
        return storage.redact(self.prefix + self.path(*parts))

    def _entries(self) -> list[pafs.FileInfo]:
        if self.fs.get_file_info(self.root).type != pafs.FileType.Directory:
            return []
        return self.fs.get_file_info(pafs.FileSelector(self.root, recursive=False))

    @storage.retried
    def check_target(self) -> None:
        """An output that is a file, or in a bucket that does not exist, fails now, before
        any scoring."""
        if self.fs.get_file_info(self.root).type == pafs.FileType.File:
            raise ConfigError(f"--output {self.display()} is a file: give a folder for the "
                              "job's data/, sft/ and rejects/")
        if self.prefix and self.fs.get_file_info(self.root.split("/", 1)[0]).type == \
                pafs.FileType.NotFound:
            raise ConfigError(f"the output bucket {self.root.split('/', 1)[0]} does not exist: "
                              "create it or choose another --output")

    @storage.retried
    def clear(self) -> None:
        """--mode overwrite: delete what this job wrote here, refusing if the folder holds
        anything else (a mistyped --output must not wipe someone's data)."""
        entries = self._entries()
        foreign = [e.base_name for e in entries
                   if e.base_name not in _OURS and not e.base_name.startswith("_tmp-")]
        if foreign:
            raise ConfigError(f"refusing to overwrite {self.display()}: it holds files this job "
                              f"did not write ({', '.join(sorted(foreign)[:5])})")
        for e in entries:
            if e.base_name == LEASE:  # this run's own
                continue
            if e.type == pafs.FileType.Directory:
                self.fs.delete_dir(e.path)
            else:
                self.fs.delete_file(e.path)

    @storage.retried
    def clean_partial(self) -> int:
        """Delete temporary files, and sft/ and scores/ files without their data/ file (see
        sink.py): what a crashed run leaves. Returns how many files went."""
        stems = {posixpath.basename(p).rsplit(".", 1)[0]
                 for p in storage.list_files(self.fs, self.path("data"))}
        removed = 0
        for d in DIRS:
            info = self.fs.get_file_info(pafs.FileSelector(self.path(d), allow_not_found=True))
            for i in info:
                name = i.base_name
                if i.type != pafs.FileType.File:
                    continue
                stem = name.rsplit(".", 1)[0]
                orphan = d in ("sft", "scores") and not name.startswith((".", "_")) \
                    and stem not in stems and stem != EMPTY
                if name.startswith("_tmp-") or orphan:
                    self.fs.delete_file(i.path)
                    removed += 1
        return removed

    @storage.retried
    def load(self) -> Existing:
        ex = Existing()
        text = storage.read_text(self.fs, self.path(MANIFEST)) or \
            storage.read_text(self.fs, self.path(PREVIOUS))
        ex.manifest = json.loads(text) if text else None
        _, ex.schema = storage.parquet_schema(self.fs, self.path("data"))
        data = storage.read_parquet_dir(self.fs, self.path("data"),
                                        columns=["id", "budget", "method", "model"])
        if data is not None:
            ex.done_ids = frozenset(data.column("id").to_pylist())
            ex.per_budget = Counter(budget_label(b) for b in data.column("budget").to_pylist())
            ex.methods = set(data.column("method").to_pylist())
            ex.models = set(data.column("model").to_pylist())
            ex.budgets = set(data.column("budget").to_pylist())
        ex.rejects, ex.reject_rows, ex.reject_reasons = self.rejects()
        ex.sft = len(storage.read_jsonl_dir(self.fs, self.path("sft")))
        return ex

    @storage.retried
    def rejects(self) -> tuple[frozenset, int, Counter]:
        """What rejects/ holds: the reject_key of every row, the number of rows, the rows
        by reason."""
        table = storage.read_parquet_dir(self.fs, self.path("rejects"),
                                         columns=["source", "row", "raw", "reason"])
        if table is None:
            return frozenset(), 0, Counter()
        keys = frozenset(reject_key(s, r, w) for s, r, w in zip(
            *(table.column(c).to_pylist() for c in ("source", "row", "raw"))))
        return keys, table.num_rows, Counter(table.column("reason").to_pylist())

    @storage.retried
    def drop_failed_rejects(self, reasons: frozenset, rereads=None) -> frozenset:
        """Delete from rejects/ the rows rejected for one of `reasons` (the job's or the
        model's failures, reasons.FAILURE_REASONS, not the input's) that this run reads
        again (`rereads(source, row)`; None: all): such a reject is not final, the run
        redoes its row and records it afresh if it fails again. Each file is rewritten whole
        without them, or deleted if nothing else is left. Returns their reject_keys."""
        dropped = set()
        for path in storage.list_files(self.fs, self.path("rejects")):
            if not path.endswith(".parquet"):
                continue
            found = pq.read_table(path, filesystem=self.fs, columns=["reason"]).column("reason")
            if not set(found.to_pylist()) & reasons:
                continue
            table = pq.read_table(path, filesystem=self.fs)
            rows = table.to_pylist()
            drop = [r["reason"] in reasons and (rereads is None or rereads(r["source"], r["row"]))
                    for r in rows]
            if not any(drop):
                continue
            dropped |= {reject_key(r["source"], r["row"], r["raw"])
                        for r, d in zip(rows, drop) if d}
            if all(drop):
                self.fs.delete_file(path)
            else:
                storage.write_atomic(self.fs, path, table.filter(pa.array([not d for d in drop])))
        return frozenset(dropped)

    @storage.retried
    def conform(self, schema: pa.Schema, sub: str = "data") -> int:
        """Rewrite every file of `sub` whose schema is not `schema` (the run's: for data/,
        earlier runs' columns, then this run's new extra columns; for scores/, a column an
        older version did not write) with the missing columns null-filled, so that the
        folder has one schema and plain glob reads (polars, duckdb, `datasets`) see every
        row and every column. Each file is replaced whole under its own name (a data/ file
        stays its group's commit marker) and keeps its rows; a rerun after a crash finishes
        the rest. Returns how many files were rewritten."""
        rewritten = 0
        for path in storage.list_files(self.fs, self.path(sub)):
            if not path.endswith(".parquet"):
                continue
            have = pq.read_schema(path, filesystem=self.fs)
            if have.equals(schema, check_metadata=False):
                continue
            lost = set(have.names) - set(schema.names)
            if lost:  # cannot happen: the run's schema keeps every earlier column
                raise RuntimeError(f"{path}: columns {sorted(lost)} are not in the run's schema")
            table = pq.read_table(path, filesystem=self.fs)
            columns = [table.column(f.name).cast(f.type) if f.name in have.names
                       else pa.nulls(table.num_rows, f.type) for f in schema]
            storage.write_atomic(self.fs, path, pa.Table.from_arrays(columns, schema=schema))
            rewritten += 1
        return rewritten

    @storage.retried
    def ensure_files(self, schemas: dict[str, pa.Schema]) -> None:
        """Give each parquet folder without a file one empty file of its schema (EMPTY)."""
        for sub, schema in schemas.items():
            if not [p for p in storage.list_files(self.fs, self.path(sub))
                    if p.endswith(".parquet")]:
                storage.write_atomic(self.fs, self.path(sub, f"{EMPTY}.parquet"),
                                     schema.empty_table())

    @storage.retried
    def write_dataset_info(self, sft_format: str) -> None:
        """LLaMA-Factory's dataset_info.json beside sft/, for the formats it reads: train
        with `dataset_dir: <output>` and `dataset: mist`."""
        entry = llamafactory_entry(sft_format)
        if entry is not None:
            text = json.dumps({LLAMAFACTORY_NAME: entry}, indent=2) + "\n"
            storage.write_atomic(self.fs, self.path(DATASET_INFO), text.encode("utf-8"))

    @storage.retried
    def stash_manifest(self) -> None:
        """While a run writes, no _manifest.json: its presence means a run finished. The
        last one is kept aside for the run history."""
        if self.fs.get_file_info(self.path(MANIFEST)).type == pafs.FileType.File:
            self.fs.move(self.path(MANIFEST), self.path(PREVIOUS))

    @storage.retried
    def write_manifest(self, manifest: dict) -> None:
        text = json.dumps(manifest, indent=2, ensure_ascii=False, sort_keys=False) + "\n"
        storage.write_atomic(self.fs, self.path(MANIFEST), text.encode("utf-8"))
        if self.fs.get_file_info(self.path(PREVIOUS)).type == pafs.FileType.File:
            self.fs.delete_file(self.path(PREVIOUS))

    @storage.retried
    def totals(self) -> dict:
        """Read data/, sft/ and rejects/ back: rows per budget, duplicates, the mean share
        of chain tokens and of words kept per budget."""
        data = storage.read_parquet_dir(self.fs, self.path("data"),
                                        columns=["id", "budget", "kept_tokens", "cot_tokens",
                                                 "kept_words", "cot_words"])
        out = {"examples": 0, "rows_per_budget": {}, "duplicate_rows": 0,
               "mean_kept_ratio": {}, "mean_kept_word_ratio": {}, "rejects": 0,
               "sft_records": 0}
        if data is not None and data.num_rows:
            out["examples"] = len(set(data.column("id").to_pylist()))
            groups = data.group_by(["id", "budget"]).aggregate([("id", "count")])
            out["duplicate_rows"] = int(pc.sum(pc.subtract(groups.column("id_count"), 1)).as_py())

            def share(kept: str, total: str):
                return pc.divide(pc.cast(data.column(kept), pa.float64()),
                                 pc.cast(data.column(total), pa.float64()))

            # Word counts are null in rows written before they were recorded: mean skips them.
            by = pa.table({"budget": data.column("budget"), "n": data.column("id"),
                           "tokens": share("kept_tokens", "cot_tokens"),
                           "words": share("kept_words", "cot_words")}).group_by("budget").aggregate(
                [("n", "count"), ("tokens", "mean"), ("words", "mean")])
            for b, n, tokens, words in zip(*(by.column(c).to_pylist() for c in
                                             ("budget", "n_count", "tokens_mean", "words_mean"))):
                out["rows_per_budget"][budget_label(b)] = n
                out["mean_kept_ratio"][budget_label(b)] = round(tokens, 4)
                if words is not None:
                    out["mean_kept_word_ratio"][budget_label(b)] = round(words, 4)
            for key in ("rows_per_budget", "mean_kept_ratio", "mean_kept_word_ratio"):
                out[key] = dict(sorted(out[key].items()))
        rejects = storage.read_parquet_dir(self.fs, self.path("rejects"), columns=["reason"])
        out["rejects"] = 0 if rejects is None else rejects.num_rows
        out["sft_records"] = len(storage.read_jsonl_dir(self.fs, self.path("sft")))
        return out

    @storage.retried
    def example(self, budget: float) -> dict | None:
        """One data/ row at a budget, for the summary."""
        for path in storage.list_files(self.fs, self.path("data")):
            table = pq.read_table(path, filesystem=self.fs, columns=list(DATA_COLUMNS))
            rows = table.filter(pc.equal(table.column("budget"), budget)).slice(0, 1).to_pylist()
            if rows:
                return rows[0]
        return None
