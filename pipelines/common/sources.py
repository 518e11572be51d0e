"""The read stage: every input becomes rows of (input, source, row, raw bytes).

Rows stay raw here on purpose. A JSONL line is split off as bytes and parsed later, in the
validate stage, so that a line with broken JSON or broken UTF-8 becomes a reject with its
reason instead of failing the read. Parquet, Hugging Face and demo rows are turned into the
same form (a JSON object per row), so one validate stage serves every input."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.datasource import FileBasedDatasource

from . import storage

RAW_SCHEMA = pa.schema([("input", pa.int64()), ("source", pa.string()), ("row", pa.int64()),
                        ("raw", pa.binary()),
                        ("error", pa.string())])  # set only on a file's unreadable_file record
# Errors that mean a file's content cannot be parsed: a corrupt or truncated parquet file, a
# feature pyarrow cannot decode, invalid UTF-8 in a parquet string column. Such a file gives
# one reject record instead of failing the job. OSError is left out on purpose: it is also how
# a transient storage failure shows, and that must fail (and retry) the read, never drop rows.
# (Some damage, e.g. a corrupt snappy page or gzip stream, also shows as OSError and so still
# fails the job.)
FORMAT_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError)
BLOCK_ROWS = 1000
_HF = re.compile(r"^hf://(?P<name>[^:@]+)(?::(?P<config>[^@]+))?(?:@(?P<split>.+))?$")
_DEMO = re.compile(r"^demo(?::(?P<n>\d+))?(?::seed=(?P<seed>\d+))?$")


def _json_bytes(row: dict) -> bytes:
    # default=str: dates, decimals and bytes from parquet become text rather than an error.
    return json.dumps(row, ensure_ascii=False, default=str).encode("utf-8")


def _raw_table(input_idx: int, source: str, rows: list[tuple[int, bytes]],
               error: str | None = None) -> pa.Table:
    return pa.table({"input": [input_idx] * len(rows), "source": [source] * len(rows),
                     "row": [r for r, _ in rows], "raw": [b for _, b in rows],
                     "error": [error] * len(rows)}, schema=RAW_SCHEMA)


def jsonl_lines(f, chunk: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes) of a stream, without decoding it. Blank lines are
    skipped (they are not rows); CRLF endings and a UTF-8 byte-order mark are removed."""
    buf, lineno = b"", 0
    while True:
        data = f.read(chunk)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            lineno += 1
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            line = line.rstrip(b"\r")
            if line.strip():
                yield lineno, line
    if buf.strip():
        lineno += 1
        if lineno == 1 and buf.startswith(b"\xef\xbb\xbf"):
            buf = buf[3:]
        yield lineno, buf.rstrip(b"\r")


class CorpusFiles(FileBasedDatasource):
    """JSONL and parquet files of one input, read in streamed blocks of raw rows.
    `row_limits` (source -> last row), when given, keeps only rows up to that number."""

    def __init__(self, files: list[tuple[str, str]], *, filesystem, prefix: str, input_idx: int,
                 row_limits: dict[str, int] | None = None):
        self._formats = {p: f for p, f in files}
        self._prefix = prefix
        self._input_idx = input_idx
        self._row_limits = row_limits
        super().__init__([p for p, _ in files], filesystem=filesystem)

    def _format(self, path: str) -> str:
        return self._formats.get(path) or storage.detect_format(path) or "jsonl"

    def _open_input_source(self, filesystem, path: str, **open_args):
        if self._format(path) == "parquet":  # parquet needs random access
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f, path: str) -> Iterator[pa.Table]:
        source = self._prefix + path
        limit = None if self._row_limits is None else self._row_limits.get(source, 0)
        rows = self._parquet_rows(f) if self._format(path) == "parquet" else jsonl_lines(f)
        block, last, error = [], 0, None
        try:
            for row, raw in rows:
                if limit is not None and row > limit:
                    break
                block.append((row, raw))
                last = row
                if len(block) >= BLOCK_ROWS:
                    yield _raw_table(self._input_idx, source, block)
                    block = []
        except FORMAT_ERRORS as e:
            # The rest of the file cannot be read. One record, numbered after the last row
            # read, stands for it and becomes an unreadable_file reject in the validate stage;
            # the rows before the damage are used as usual. Both passes see the same record.
            error = f"{type(e).__name__}: {e}"
        if block:
            yield _raw_table(self._input_idx, source, block)
        if error is not None and (limit is None or last < limit):
            yield _raw_table(self._input_idx, source, [(last + 1, b"")], error)

    @staticmethod
    def _parquet_rows(f) -> Iterator[tuple[int, bytes]]:
        pf = pq.ParquetFile(f)
        n = 0
        # One row group at a time (a batch would otherwise span row groups), so that the rows
        # of the groups before a damaged one are all read.
        for group in range(pf.num_row_groups):
            for batch in pf.iter_batches(batch_size=BLOCK_ROWS, row_groups=[group]):
                for row in batch.to_pylist():
                    n += 1
                    yield n, _json_bytes(row)


@dataclass
class Input:
    """One --input: files on a filesystem, or rows made on the driver (hf://, demo)."""

    uri: str
    index: int
    files: list[tuple[str, str]] = field(default_factory=list)
    filesystem: object = None
    prefix: str = ""
    table: pa.Table | None = None  # raw rows, for hf:// and demo inputs

    @property
    def source(self) -> str:
        return storage.redact(self.uri)


def parse_hf(uri: str) -> tuple[str, str | None, str]:
    """hf://owner/name[:config][@split] -> (name, config, split); the split defaults to train."""
    m = _HF.match(uri)
    if not m:
        raise ValueError(f"bad Hugging Face URI {uri!r}: use hf://owner/name[:config][@split]")
    return m["name"], m["config"], m["split"] or "train"


def _rows_table(input_idx: int, source: str, rows: list[dict]) -> pa.Table:
    return _raw_table(input_idx, source, [(i + 1, _json_bytes(r)) for i, r in enumerate(rows)])


def hf_table(uri: str, input_idx: int) -> pa.Table:
    """A Hugging Face dataset split, loaded on the driver through `datasets`."""
    import datasets

    name, config, split = parse_hf(uri)
    ds = datasets.load_dataset(name, config, split=split)
    n, tables = 0, []
    for batch in ds.with_format("arrow").iter(batch_size=BLOCK_ROWS):
        rows = [(n + i + 1, _json_bytes(r)) for i, r in enumerate(batch.to_pylist())]
        n += len(rows)
        tables.append(_raw_table(input_idx, uri, rows))
    return pa.concat_tables(tables) if tables else RAW_SCHEMA.empty_table()


def demo_table(spec: str, input_idx: int) -> pa.Table:
    """`demo`, `demo:N` or `demo:N:seed=S`: the built-in corpus (mist_core.data.demo)."""
    from mist_core.data.demo import DEMO_SIZE, demo_corpus

    m = _DEMO.match(spec)
    if not m:
        raise ValueError(f"bad demo input {spec!r}: use demo, demo:N or demo:N:seed=S")
    rows = demo_corpus(int(m["n"] or DEMO_SIZE), int(m["seed"] or 0))
    return _rows_table(input_idx, spec, rows)


def check_submitted_paths(inputs: list[str], output: str) -> None:
    """Under `ray job submit` the driver's current folder is Ray's temporary copy of the
    working directory: a relative --input would be looked for there, and a relative
    --output would be written there and lost. Refuse them (ValueError, one line)."""
    if not storage.under_job_submit():
        return
    named = [("--output", output)] + [("--input", u) for u in inputs
                                      if not (u.startswith("hf://") or _DEMO.match(u))]
    for flag, uri in named:
        if storage.relative_path(uri):
            there = "the output would be lost" if flag == "--output" else "it is looked for"
            raise ValueError(
                f"{flag} {uri} is a relative path, but this run was started by `ray job "
                "submit`, whose driver runs in Ray's temporary copy of the working directory "
                f"({there} there): give an absolute path (e.g. \"$PWD/{uri}\") or a URI "
                "(s3://…, gs://…)")


def resolve_inputs(uris: list[str], fmt: str = "auto") -> list[Input]:
    """Find every input's files (or build its rows) once, on the driver, so that both passes
    of a run read exactly the same files."""
    out = []
    for i, uri in enumerate(uris):
        if uri.startswith("hf://"):
            out.append(Input(uri, i, table=hf_table(uri, i)))
        elif _DEMO.match(uri):
            out.append(Input(uri, i, table=demo_table(uri, i)))
        else:
            fs, files, prefix = storage.input_files(uri, fmt)
            out.append(Input(uri, i, files=files, filesystem=fs, prefix=prefix))
    return out


def read_raw(inputs: list[Input], row_limits: dict[str, int] | None = None,
             memory: float | None = None) -> ray.data.Dataset:
    """One dataset of raw rows over all inputs. With `row_limits`, only the sources it
    names are read, each up to its last row (that is how --limit takes a prefix).
    `memory`: bytes each read task reserves."""
    parts = []
    for inp in inputs:
        if inp.table is not None:
            table = inp.table
            if row_limits is not None:
                last = row_limits.get(inp.table["source"][0].as_py() if len(table) else "", 0)
                table = table.slice(0, last)
            if len(table):
                parts.append(ray.data.from_arrow(table))
            continue
        files = inp.files
        if row_limits is not None:
            files = [(p, f) for p, f in files if inp.prefix + p in row_limits]
        if files:
            parts.append(ray.data.read_datasource(CorpusFiles(
                files, filesystem=inp.filesystem, prefix=inp.prefix, input_idx=inp.index,
                row_limits=row_limits), memory=memory))
    if not parts:
        return ray.data.from_arrow(RAW_SCHEMA.empty_table())
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
