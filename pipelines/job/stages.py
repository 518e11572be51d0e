"""The job's per-row work: validate and tokenize (CPU tasks), score (an actor holding one
model replica), prune (CPU tasks).

Every stage keeps one row per input row, in one schema (STREAM_SCHEMA): a row that cannot go
on is marked `status = "reject"` with a reason and carried to the writer, and a row already
in the output is marked `status = "skip"`. Nothing is filtered out along the way, so the
writer sees every row read and the counts can be reconciled exactly."""
from __future__ import annotations

import json
import logging
import time
import traceback

import numpy as np
import pyarrow as pa

from mist_core import (Example, InvalidExample, NonFiniteScores, load_model,
                       reasons)
from mist_core.data.formats import value_kind
from mist_core.data.templates import Encoded
from mist_core.scoring.prune import prune_scores, token_pieces

from ..common import faults
from . import placement
from ..common.rows import parse_examples, readable_id, template_for
from .config import JobConfig
from ..common.errors import ModelLoadError

log = logging.getLogger(__name__)

_ints, _floats = pa.list_(pa.int64()), pa.list_(pa.float64())
STREAM_SCHEMA = pa.schema([
    ("input", pa.int64()), ("source", pa.string()), ("row", pa.int64()),
    ("status", pa.string()), ("reason", pa.string()), ("detail", pa.string()),
    ("raw", pa.string()),  # the input row as text, kept for rejects only
    ("id", pa.string()), ("question", pa.string()), ("cot", pa.string()),
    ("answer", pa.string()), ("extra", pa.string()),  # extra input columns, a JSON object
    # tokenized (validate stage); see mist_core.data.templates.Encoded
    ("source_ids", _ints), ("chain_start", pa.int64()), ("chain_len", pa.int64()),
    ("answer_start", pa.int64()), ("target_ids", _ints), ("target_final", pa.int64()),
    ("chain_offsets", _ints), ("n_tokens", pa.int64()),
    # score stage
    ("scores", _floats), ("necessity", _floats), ("sufficiency", _floats),
    ("facts_necessity", _floats), ("score_s", pa.float64()),
    # prune stage, one entry per budget
    ("compressed", pa.list_(pa.string())), ("kept_tokens", _ints), ("tokens", pa.list_(pa.string())),
])
OK, REJECT, SKIP = "ok", "reject", "skip"

# The reasons (declared with their words in mist_core/reasons.py) that name a failure of the
# job or of the model rather than of the row: they count against --max-error-share, and
# their rejects are not final (a later run redoes the rows, Output.drop_failed_rejects).
SCORE_ERROR = "score_error"  # the scorer raised
NONFINITE_SCORES = NonFiniteScores.REASON  # NaN or inf from the model
PRUNE_ERROR = "prune_error"  # pruning raised
UNEXPECTED_ERROR = "unexpected_error"  # validating or tokenizing raised (a bug, not a reason)

def _raw_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="backslashreplace")


def _reject(row: dict, reason: str, detail: str = "") -> dict:
    """Every reject says what was wrong in a sentence as well as a code."""
    row.update(status=REJECT, reason=reasons.check(reason), detail=detail or reasons.words(reason))
    return row


def _failed(row: dict, e: Exception, rec: dict) -> dict:
    """A row rejected with the reason of an InvalidExample, or as unexpected_error (a bug or
    a tokenizer failure on odd text: the row is kept and says why)."""
    if isinstance(e, InvalidExample):
        return _reject(row, e.reason, e.detail)
    log.warning("unexpected error on %s row %s: %r", rec["source"], rec["row"], e)
    return _reject(row, UNEXPECTED_ERROR, f"{type(e).__name__}: {e}")


def plan_batch(batch: pa.Table, *, adapter: str, columns: dict) -> pa.Table:
    """The planning pass: each row's example ids, in order (null if it fails validation), and
    the value kinds of its extra columns. Cheap (no tokenizer): it sizes the run before any
    scoring."""
    keys, kinds = [], []
    for raw, error in zip(batch.column("raw").to_pylist(), batch.column("error").to_pylist()):
        try:
            examples, extras = parse_examples(raw, adapter, columns, error)
        except Exception:  # InvalidExample, or what prepare_batch rejects as unexpected_error
            keys.append(None)
            kinds.append(None)
            continue
        keys.append([ex.key for ex in examples])
        kinds.append(json.dumps({k: value_kind(v) for k, v in sorted(extras.items())}))
    return pa.table({"input": batch.column("input"), "source": batch.column("source"),
                     "row": batch.column("row"), "keys": pa.array(keys, pa.list_(pa.string())),
                     "kinds": pa.array(kinds, pa.string())})


def prepare_batch(batch: pa.Table, *, cfg: JobConfig, done_ids: frozenset,
                  dup_rows: frozenset) -> pa.Table:
    """Validate and tokenize: raw rows -> examples ready for the scorer, or rejects/skips.
    A row gives one stream row per example (several for openr1), or one reject. Settings:
    cfg's adapter, columns, model, template, trust_remote_code. `done_ids`: ids already in
    the output (refresh); `dup_rows`: (source, row, index of the example in its row) of
    examples whose id appeared earlier in the input."""
    adapter, columns = cfg.adapter, cfg.columns
    tmpl = template_for(cfg.model, cfg.template, cfg.trust_remote_code)
    out = []
    for rec in batch.to_pylist():
        where = {"input": rec["input"], "source": rec["source"], "row": rec["row"]}
        raw = rec["raw"]
        try:
            examples, extras = parse_examples(raw, adapter, columns, rec.get("error"))
        except Exception as e:
            row = dict(where, status=OK, id=readable_id(raw, adapter, columns))
            out.append(_failed(row, e, rec) | {"raw": _raw_text(raw)})
            continue
        for part, ex in enumerate(examples):
            row = dict(where, status=OK, id=ex.key, question=ex.question, cot=ex.cot,
                       answer=ex.answer)
            try:
                if ex.key in done_ids:
                    row["status"] = SKIP
                elif (rec["source"], rec["row"], part) in dup_rows:
                    raise InvalidExample("duplicate_id",
                                         f"id {ex.key} appears earlier in the input")
                else:
                    enc = tmpl.encode(ex)
                    row.update(extra=json.dumps(extras, ensure_ascii=False, default=str),
                               source_ids=enc.source_ids.tolist(), chain_start=enc.chain_start,
                               chain_len=enc.chain_len, answer_start=enc.answer_start,
                               target_ids=enc.target_ids.tolist(), target_final=enc.target_final,
                               chain_offsets=enc.chain_offsets.reshape(-1).tolist(),
                               n_tokens=len(enc.source_ids) + len(enc.target_ids))
            except Exception as e:
                _failed(row, e, rec)
            if row["status"] == REJECT:
                # The reject's raw text (part of its identity in rejects/): the row, or for
                # one of a row's several examples that example alone, so that each rejected
                # example is a record of its own and a rerun recognises it.
                row["raw"] = _raw_text(raw) if len(examples) == 1 else json.dumps(
                    {k: row[k] for k in ("id", "question", "cot", "answer")}, ensure_ascii=False)
            out.append(row)
    # Length-aware batching, first half: the scoring actors take consecutive rows as a batch,
    # so sorting each block by length gives them batches of similar lengths (the scorer then
    # packs each batch into forward passes of at most batch_tokens padded tokens).
    out.sort(key=lambda r: (r["status"] != OK, r.get("n_tokens") or 0))
    return pa.Table.from_pylist(out, schema=STREAM_SCHEMA)


def _encoded(row: dict) -> Encoded:
    ex = Example(row["question"], row["cot"], row["answer"], id=row["id"])
    return Encoded(example=ex, source_ids=np.asarray(row["source_ids"], np.int64),
                   chain_start=row["chain_start"], chain_len=row["chain_len"],
                   answer_start=row["answer_start"],
                   target_ids=np.asarray(row["target_ids"], np.int64),
                   target_final=row["target_final"],
                   chain_offsets=np.asarray(row["chain_offsets"], np.int64).reshape(-1, 2))


def _floats_or_none(v) -> list | None:
    return None if v is None else np.asarray(v, np.float64).tolist()


class ScoreActor:
    """One model replica. Ray Data builds one per actor of the pool and calls it on batches
    of rows; the scorer groups each batch by length into forward passes of at most
    `batch_tokens` padded tokens, so short chains are not padded to long ones."""

    def __init__(self, cfg: JobConfig, *, device: str, stats=None):
        """Settings: cfg's model, method, dtype, alpha, layer_weights, template, batch_size,
        batch_tokens, max_memory, trust_remote_code, cpus_per_actor (torch's threads on a CPU);
        `device`: placement.resolve_device's; `stats`: the placement.ActorStats to report to."""
        import torch

        model, method, dtype = cfg.model, cfg.method, cfg.dtype
        if device == "cpu":
            torch.set_num_threads(max(1, int(cfg.cpus_per_actor)))
        self.stats, self.place = stats, placement.here() | {"device": device}
        if device == "cuda" and not torch.cuda.is_available():  # ends the run, exit status 2
            raise ModelLoadError(
                f"--device cuda, but the scoring actor on node {self.place['node_id']} "
                f"({self.place['node_ip']}) sees no CUDA device (Ray assigned it GPUs "
                f"{self.place['accelerator_ids'].get('GPU', [])}, torch "
                f"{torch.__version__}{'' if torch.version.cuda else ' built without CUDA'}); "
                "use --device cpu or auto")
        t = time.perf_counter()
        try:
            self.lm = load_model(model, dtype=dtype, device=device,
                                 trust_remote_code=cfg.trust_remote_code)
        except Exception as e:  # the driver turns this into one line, with no retry
            raise ModelLoadError(f"a scoring actor could not load --model {model}: "
                                 f"{type(e).__name__}: {e}") from e
        self.scorer = cfg.scoring().scorer(self.lm)
        self.scored, self.busy, self.batches = 0, 0.0, 0
        # Of the chains scored, those the scorer rejected; when this process began scoring
        # (time.time(), for the driver's rate and ETA); when it last reported (monotonic).
        self.rejected, self.started, self._reported = 0, None, 0.0
        self._report()
        print(f"[score] actor ready: {self.lm.name} ({method}, {dtype}) on {device}, "
              f"loaded in {time.perf_counter() - t:.1f}s", flush=True)

    def _report(self) -> None:
        """This actor's place and running totals, to the run's ActorStats (placement)."""
        placement.report(self.stats, self.place | {"chains_scored": self.scored,
                                                   "chains_rejected": self.rejected,
                                                   "busy_seconds": round(self.busy, 3),
                                                   "batches": self.batches}, self.started)
        self._reported = time.monotonic()

    def _score_each(self, encs: list[Encoded]) -> list:
        """After a failed batch: score one by one, so that one bad row fails alone."""
        out = []
        for enc in encs:
            try:
                faults.before_score([enc.example.id])
                out.append(self.scorer.score_encoded([enc], errors="return")[0])
            except Exception as e:
                out.append(e)
        return out

    def _score_part(self, encs: list[Encoded]) -> list:
        try:
            return self.scorer.score_encoded(encs, errors="return")
        except Exception:
            print(f"[score] batch of {len(encs)} failed, retrying one by one:\n"
                  f"{traceback.format_exc()}", flush=True)
            return self._score_each(encs)

    @staticmethod
    def _settle(row: dict, res) -> None:
        """A row's scores, or its reject, from the scorer's result."""
        if isinstance(res, InvalidExample):  # too_long_for_memory, nonfinite_scores
            _reject(row, res.reason, res.detail)
        elif isinstance(res, Exception):
            _reject(row, SCORE_ERROR, f"{type(res).__name__}: {res}")
        elif not np.all(np.isfinite(res.scores)):
            _reject(row, NONFINITE_SCORES, "the scorer returned NaN or inf")
        else:
            row.update(scores=_floats_or_none(res.scores),
                       necessity=_floats_or_none(res.necessity),
                       sufficiency=_floats_or_none(res.sufficiency),
                       facts_necessity=_floats_or_none(res.facts_necessity))
        if row["status"] == REJECT:
            row["raw"] = json.dumps({"id": row["id"], "question": row["question"],
                                     "cot": row["cot"], "answer": row["answer"]},
                                    ensure_ascii=False)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        todo = [r for r in rows if r["status"] == OK]
        if todo:
            t, busy = time.perf_counter(), self.busy
            if self.started is None:  # said at once: the driver's line stops saying
                self.started = time.time()  # "loading the model" during a long first pass
                self._report()
            encs = [_encoded(r) for r in todo]
            try:
                faults.before_score([r["id"] for r in todo])
                parts, alone = self.scorer.forward_batches(encs), False
            except Exception:
                print(f"[score] batch of {len(encs)} failed, retrying one by one:\n"
                      f"{traceback.format_exc()}", flush=True)
                parts, alone = [[i] for i in range(len(encs))], True
            # One forward pass at a time, so that the driver's progress line moves during a
            # call: a report (one fire-and-forget call) at most every REPORT_S seconds.
            for idx in parts:
                part = [encs[i] for i in idx]
                results = self._score_each(part) if alone else self._score_part(part)
                for i, res in zip(idx, results):
                    self._settle(todo[i], res)
                    self.rejected += todo[i]["status"] == REJECT
                self.scored += len(idx)
                if time.monotonic() - self._reported >= placement.REPORT_S:
                    self.busy = busy + time.perf_counter() - t
                    self._report()
            dt = time.perf_counter() - t
            for row in todo:
                if row["status"] == OK:
                    row["score_s"] = dt / len(todo)
            self.busy = busy + dt
            self.batches += 1
            faults.after_score_batch(self.batches)
            self._report()
            print(f"[score] {len(todo)} chains in {dt:.1f}s; this actor: {self.scored} chains, "
                  f"{self.scored / self.busy:.2f} chains/s", flush=True)
        for row in rows:
            row["target_ids"] = None  # the no-chain input is not needed past scoring
        return pa.Table.from_pylist(rows, schema=STREAM_SCHEMA)


def prune_batch(batch: pa.Table, *, cfg: JobConfig) -> pa.Table:
    """Scores -> one compressed chain per budget. Score arrays travel on only when the
    scores/ output was asked for. Settings: cfg's budgets, unit, keep_digits, facts_first,
    sentences_first, scores."""
    budgets, unit, keep_digits, with_scores = cfg.budgets, cfg.unit, cfg.keep_digits, cfg.scores
    rows = batch.to_pylist()
    for row in rows:
        if row["status"] == OK:
            if row["scores"] is None:
                raise RuntimeError(f"{row['source']} row {row['row']} reached pruning unscored")
            ex = Example(row["question"], row["cot"], row["answer"], id=row["id"])
            offsets = np.asarray(row["chain_offsets"], np.int64).reshape(-1, 2)
            try:
                chains = prune_scores(ex, row["scores"], offsets, budgets, unit, keep_digits,
                                      cfg.facts_first, sentences_first=cfg.sentence_rule)
            except Exception as e:
                _reject(row, PRUNE_ERROR, f"{type(e).__name__}: {e}")
                row["raw"] = json.dumps({"id": row["id"], "question": row["question"],
                                         "cot": row["cot"], "answer": row["answer"]},
                                        ensure_ascii=False)
            else:
                row["compressed"] = [c.text for c in chains]
                row["kept_tokens"] = [c.kept_tokens for c in chains]
                if with_scores:
                    row["tokens"] = token_pieces(ex.cot, offsets)
        if not with_scores or row["status"] != OK:
            row.update(source_ids=None, scores=None, necessity=None, sufficiency=None,
                       facts_necessity=None)
        row["chain_offsets"] = None
    return pa.Table.from_pylist(rows, schema=STREAM_SCHEMA)
