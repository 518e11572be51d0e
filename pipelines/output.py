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

from mist_core.formats import DATA_COLUMNS, budget_label

from . import storage
from .config import ConfigError
from .sink import DIRS, reject_key

MANIFEST = "_manifest.json"
PREVIOUS = "_manifest.previous.json"  # an earlier manifest while a run is in progress
_OURS = set(DIRS) | {MANIFEST, PREVIOUS}


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
                orphan = d in ("sft", "scores") and not name.startswith((".", "_")) \
                    and name.rsplit(".", 1)[0] not in stems
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
        rejects = storage.read_parquet_dir(self.fs, self.path("rejects"),
                                           columns=["source", "row", "raw"])
        if rejects is not None:
            ex.rejects = frozenset(reject_key(s, r, w) for s, r, w in zip(
                *(rejects.column(c).to_pylist() for c in ("source", "row", "raw"))))
            ex.reject_rows = rejects.num_rows
        ex.sft = len(storage.read_jsonl_dir(self.fs, self.path("sft")))
        return ex

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
        """Read data/, sft/ and rejects/ back: rows per budget, duplicates, kept ratios."""
        data = storage.read_parquet_dir(self.fs, self.path("data"),
                                        columns=["id", "budget", "kept_tokens", "cot_tokens"])
        out = {"examples": 0, "rows_per_budget": {}, "duplicate_rows": 0,
               "mean_kept_ratio": {}, "rejects": 0, "sft_records": 0}
        if data is not None and data.num_rows:
            out["examples"] = len(set(data.column("id").to_pylist()))
            groups = data.group_by(["id", "budget"]).aggregate([("id", "count")])
            out["duplicate_rows"] = int(pc.sum(pc.subtract(groups.column("id_count"), 1)).as_py())
            ratio = pc.divide(pc.cast(data.column("kept_tokens"), pa.float64()),
                              pc.cast(data.column("cot_tokens"), pa.float64()))
            by = pa.table({"budget": data.column("budget"), "ratio": ratio}).group_by(
                "budget").aggregate([("ratio", "mean"), ("ratio", "count")])
            for b, mean, n in zip(*(by.column(c).to_pylist()
                                    for c in ("budget", "ratio_mean", "ratio_count"))):
                out["rows_per_budget"][budget_label(b)] = n
                out["mean_kept_ratio"][budget_label(b)] = round(mean, 4)
            out["rows_per_budget"] = dict(sorted(out["rows_per_budget"].items()))
            out["mean_kept_ratio"] = dict(sorted(out["mean_kept_ratio"].items()))
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
