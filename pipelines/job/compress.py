"""The compression job: read -> validate and tokenize -> score -> prune -> write, streamed
through Ray Data. `python -m pipelines.compress --help` explains the options.

A run makes two passes over its input. The first, cheap one (read and validate, no model)
counts the rows, finds ids that repeat or are already in the output, and fixes the types
of the extra columns; the second does the work. The counts of the two are reconciled at the
end, and the manifest is written only if they agree."""
from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow as pa
import ray

from mist_core import reasons
from mist_core.data.formats import (DATA_COLUMNS, REJECT_SCHEMA, SCORES_SCHEMA, budget_label,
                                    data_schema, fits, kinds_type, sft_budgets, sft_format_name)
from mist_core.scoring.choices import OPTIONS

from ..common import exits, rows, runtime, storage
from . import lease, placement, stages
from ..common.settings import one_line, parse
from .config import JobConfig
from ..common.errors import AccountingError, ConfigError, ErrorBudgetExceeded, causes
from .output import Existing, Output
from .budget import ErrorBudget, start_tally
from .sink import OutputSink, WriteStats
from ..common.sources import Input, check_submitted_paths, read_raw, resolve_inputs

log = logging.getLogger("pipelines.compress")
TASK_MEMORY = 512 * 1024**2  # bytes per read/tokenize task: a tokenizer and a block of rows
# Rows per scoring call, in forward batches: a call packs its rows by length into forward
# passes, and a larger call packs better (measured in docs/results/performance.md, "Bigger
# actor calls").
CALL_BATCHES = 8


@dataclass
class Plan:
    read: int  # input rows
    # What the rows expand to, each of which ends scored, rejected or already done: one per
    # row, or one per example for an adapter that fans a row out (openr1); a row that gives
    # no example counts once, as its reject.
    examples: int
    invalid: int  # rows rejected by validation already in the planning pass
    done: int  # examples already in the output
    duplicates: int
    to_score: int
    row_limits: dict[str, int] | None
    dup_rows: frozenset
    extras: pa.Schema
    seconds: float
    sources: frozenset | None = None  # the sources (files) of the rows read; None: unknown


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def extras_schema(kinds: dict[str, set], existing: Existing) -> pa.Schema:
    """The extra columns' types: from the value kinds seen in this input, and, on refresh,
    the types already in data/ (a file of this run must not contradict an earlier one).
    Earlier columns come first, in their order, then this run's new ones by name, so that
    every file of the folder has the same columns in the same order (Output.conform)."""
    old = existing.schema
    fields = [f for f in old if f.name not in DATA_COLUMNS] if old is not None else []
    for f in fields:
        if f.name in kinds and not fits(kinds[f.name], f.type):
            raise ConfigError(
                f"extra column {f.name!r} holds {sorted(kinds[f.name] - {'null'})} values, but "
                f"the output has it as {f.type}; use --mode overwrite or another --output")
    known = {f.name for f in fields}
    fields += [pa.field(name, kinds_type(kinds[name])) for name in sorted(kinds)
               if name not in known]
    return pa.schema(fields)


def make_plan(inputs: list[Input], cfg: JobConfig, existing: Existing) -> Plan:
    t = time.perf_counter()
    ds = read_raw(inputs).map_batches(
        stages.plan_batch, batch_format="pyarrow",
        fn_kwargs={"adapter": cfg.adapter, "columns": cfg.columns})
    tables = list(ds.iter_batches(batch_format="pyarrow", batch_size=None))
    table = pa.concat_tables(tables) if tables else pa.table(
        {"input": pa.array([], pa.int64()), "source": pa.array([], pa.string()),
         "row": pa.array([], pa.int64()), "keys": pa.array([], pa.list_(pa.string())),
         "kinds": pa.array([], pa.string())})
    # Input order: inputs as given, files by name, rows by number. --limit takes a prefix.
    table = table.sort_by([("input", "ascending"), ("source", "ascending"), ("row", "ascending")])
    row_limits = None
    if cfg.limit is not None:
        table = table.slice(0, cfg.limit)
        row_limits = {}
        for source, row in zip(table.column("source").to_pylist(), table.column("row").to_pylist()):
            row_limits[source] = max(row, row_limits.get(source, 0))
    seen, dups, kinds = set(), set(), defaultdict(set)
    invalid = done = examples = 0
    for source, row, keys, kind in zip(*(table.column(c).to_pylist()
                                          for c in ("source", "row", "keys", "kinds"))):
        if keys is None:
            invalid += 1
            examples += 1
            continue
        examples += len(keys)
        new = False
        for part, key in enumerate(keys):
            if key in existing.done_ids:
                done += 1
            elif key in seen:
                dups.add((source, row, part))
            else:
                seen.add(key)
                new = True
        if new:  # only rows that write data/ rows decide the extra columns' types
            for name, k in json.loads(kind).items():
                kinds[name].add(k)
    return Plan(read=table.num_rows, examples=examples, invalid=invalid, done=done,
                duplicates=len(dups),
                to_score=len(seen), row_limits=row_limits, dup_rows=frozenset(dups),
                extras=extras_schema(kinds, existing), seconds=time.perf_counter() - t,
                sources=frozenset(table.column("source").unique().to_pylist()))


def check_disjoint(inputs: list[Input], out: Output) -> None:
    """The output may not lie inside an input, nor an input inside the output: a run would
    overwrite its corpus, or a later refresh would read its own output back as input."""
    here = out.prefix + out.root
    for inp in inputs:
        if inp.table is not None:  # hf:// and demo rows live in no folder
            continue
        _, root, prefix = storage.filesystem(inp.uri)
        there = prefix + root
        if here == there or here.startswith(there + "/") or there.startswith(here + "/"):
            raise ConfigError(f"--output {out.display()} overlaps --input {inp.source}: "
                              "choose an output outside the input folders")


def check_compatible(cfg: JobConfig, model_name: str, existing: Existing, out: Output) -> None:
    """Refresh only adds rows made the same way as those already there."""
    problems = []
    if existing.methods and existing.methods != {cfg.method}:
        problems.append(f"method {sorted(existing.methods)} vs {cfg.method}")
    if existing.models and existing.models != {model_name}:
        problems.append(f"model {sorted(existing.models)} vs {model_name}")
    if existing.budgets and existing.budgets != set(cfg.budgets):
        problems.append(f"budgets {sorted(existing.budgets)} vs {cfg.budgets}")
    before = dict((existing.manifest or {}).get("config", {}))
    if "sft_format" in before:  # an output from before a format was renamed
        before["sft_format"] = sft_format_name(before["sft_format"])
    now = cfg.to_dict()
    if before:  # an output from before a setting was made as it was then: the paper's
        before.setdefault("layer_weights", "signed")  # weights, every unit ranked by score
        before.setdefault("facts_first", False)
        before.setdefault("target", "answer")
        if before.get("sentences_first") is None:  # every unit ranked on its own
            before["sentences_first"] = "none"
    for key in ("adapter", "columns", "unit", "alpha", "keep_digits", "facts_first",
                "sentences_first", "template", "dtype", "sft_format", "sft_mix", "seed",
                "layer_weights", "target"):
        if key in ("layer_weights", "target") and key not in OPTIONS.get(cfg.method, ()):
            continue  # MIST's own settings
        if key in before and before[key] != now[key]:
            problems.append(f"{key} {before[key]!r} vs {now[key]!r}")
    if problems:
        raise ConfigError(f"{out.display()} was made with other settings ({'; '.join(problems)}); "
                          "refresh only adds rows made the same way: use --mode overwrite or "
                          "another --output")


def reconcile(cfg: JobConfig, plan: Plan, stats: WriteStats, existing: Existing,
              totals: dict) -> None:
    problems = []

    def check(what: str, got, want) -> None:
        if got != want:
            problems.append(f"{what}: {got}, expected {want}")

    check("rows that reached the writer (examples of the rows read)", stats.rows, plan.examples)
    check("scored + rejected + already done (examples of the rows read)",
          stats.scored + stats.rejected + stats.skipped, plan.examples)
    check("rows already done", stats.skipped, plan.done)
    if stats.rejected < plan.invalid + plan.duplicates:
        problems.append(f"rejected {stats.rejected} < {plan.invalid + plan.duplicates} rows "
                        "the planning pass found invalid or repeated")
    for b in map(budget_label, cfg.budgets):
        check(f"data rows written at budget {b} (rows scored)", stats.written[b], stats.scored)
        check(f"data/ rows at budget {b}", totals["rows_per_budget"].get(b, 0),
              existing.per_budget[b] + stats.written[b])
    check("duplicate (id, budget) rows in data/", totals["duplicate_rows"], 0)
    per_example = 1 if cfg.sft_mix == "sample" else len(sft_budgets(cfg.budgets))
    check("sft records written", stats.sft, stats.scored * per_example)
    check("sft/ records", totals["sft_records"], existing.sft + stats.sft)
    check("rejects/ rows", totals["rejects"], existing.reject_rows + stats.rejects_written)
    if totals["duplicate_rows"]:  # a later run cannot mend them: say what does
        problems.append("data/ holds rows twice (as two runs writing it at once, before the "
                        "lease, left it): rebuild it with --mode overwrite")
    if problems:
        raise AccountingError("the counts do not reconcile; the output has no manifest:\n  "
                              + "\n  ".join(problems))


def build(cfg: JobConfig, inputs: list[Input], plan: Plan, existing: Existing,
          gpus: float, device: str, stats=None) -> ray.data.Dataset:
    """The streaming pipeline, up to (not including) the write. `device`: the scoring
    actors' (placement.resolve_device); `stats`: the placement.ActorStats they report to."""
    # Reading and tokenizing run as CPU tasks that reserve TASK_MEMORY. Besides the
    # accounting, the reservation keeps them out of the scoring actors: Ray Data fuses a task
    # stage into the next actor stage when both ask for the same resources (CPU actors).
    ds = read_raw(inputs, plan.row_limits, memory=TASK_MEMORY).map_batches(
        stages.prepare_batch, batch_format="pyarrow", memory=TASK_MEMORY,
        fn_kwargs={"cfg": cfg, "done_ids": existing.done_ids, "dup_rows": plan.dup_rows})
    if plan.to_score:  # no actors (no GPUs woken up) when there is nothing new
        # One scoring call per block: an actor task's rows reach the writer when its call
        # ends, not when the whole read block (up to sources.BLOCK_ROWS rows) is scored, so
        # --rows-per-file groups commit as scoring goes and the actors share the work evenly.
        ds = ds.repartition(target_num_rows_per_block=cfg.batch_size * CALL_BATCHES)
        ds = ds.map_batches(
            stages.ScoreActor, compute=runtime.actor_pool(cfg.actors), batch_size=cfg.batch_size * CALL_BATCHES,
            batch_format="pyarrow",
            fn_constructor_args=(cfg,), fn_constructor_kwargs={"device": device, "stats": stats},
            **runtime.actor_resources(cfg.cpus_per_actor, gpus))
    return ds.map_batches(stages.prune_batch, batch_format="pyarrow", fn_kwargs={"cfg": cfg})


@dataclass
class Run:
    """One run of the job, filled in as it goes: what the driver learns (the inputs, the
    plan, the placement, the counts and timings) is kept here, and the manifest is made
    from it."""
    cfg: JobConfig
    run_id: str
    started: str
    t0: float  # perf_counter at the start
    inputs: list[Input] = field(default_factory=list)
    out: Output | None = None
    model_name: str = ""
    plan: Plan | None = None
    existing: Existing | None = None
    gpus: float = 0.0
    device: str | None = None
    stats: WriteStats | None = None  # the sink's counts
    totals: dict = field(default_factory=dict)  # the output read back
    run_s: float = 0.0  # the scoring and writing
    conformed: int = 0  # earlier data/ files rewritten with new columns
    actors: list[dict] | None = None  # the scoring actors' records (placement.collect)
    own_ray: bool = False  # this process started the Ray it runs on (runtime.init_ray)

    @classmethod
    def begin(cls, cfg: JobConfig) -> "Run":
        run_id = (dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-"
                  + uuid.uuid4().hex[:6])
        return cls(cfg, run_id=run_id, started=_now(), t0=time.perf_counter())

    def manifest(self) -> dict:
        cfg, plan, stats, out = self.cfg, self.plan, self.stats, self.out
        settings = cfg.to_dict()
        settings["input"] = [i.source for i in self.inputs]
        settings["output"] = out.display()
        counts = {
            "read": plan.read, "examples": plan.examples, "scored": stats.scored,
            "rejected": stats.rejected,
            "already_done": stats.skipped,
            "rejected_by_reason": dict(sorted(stats.reasons.items())),
            "rejects_already_recorded": stats.rejected - stats.rejects_written,
            "written_per_budget": {b: stats.written[b] for b in map(budget_label, cfg.budgets)},
            "sft_records": stats.sft, "score_rows": stats.score_rows, "files_written": stats.files,
            "data_files_conformed": self.conformed,
        }
        run_s = self.run_s
        timings = {"plan_s": round(plan.seconds, 3), "run_s": round(run_s, 3),
                   "total_s": round(time.perf_counter() - self.t0, 3),
                   "actor_busy_s": round(stats.score_s, 3)}
        throughput = {
            "chains_per_s": round(stats.scored / run_s, 4) if run_s else None,
            "tokens_per_s": round(stats.tokens / run_s, 2) if run_s else None,
            "chains_per_actor_s": round(stats.scored / stats.score_s, 4) if stats.score_s else None,
        }
        runs = list((self.existing.manifest or {}).get("runs", []))
        if self.existing.done_ids and self.existing.manifest is None:
            runs.append({"run_id": None, "note": "output of an unfinished run without manifest, "
                                                 "kept and completed by the next run"})
        runs.append({"run_id": self.run_id, "started_at": self.started, "finished_at": _now(),
                     "mode": cfg.mode, "input": settings["input"], "counts": counts,
                     "timings": timings})
        return {
            "run_id": self.run_id, "started_at": self.started, "finished_at": _now(),
            "output": out.display(), "config": settings,
            "model": {"spec": cfg.model, "name": self.model_name, "dtype": cfg.dtype,
                      "device": self.device or placement.resolve_device(cfg.device, self.gpus),
                      "gpus_per_actor": self.gpus,
                      "cpus_per_actor": cfg.cpus_per_actor, "actors": list(cfg.actors)},
            "actors": self.actors,  # where each scoring actor ran and what it did (placement)
            "versions": runtime.versions(),
            "counts": counts, "totals": self.totals, "timings": timings,
            "throughput": throughput,
            "data_schema": [{"name": f.name, "type": str(f.type)}
                            for f in data_schema(plan.extras)],
            "runs": runs,
        }


def retry_failed_rows(out: Output, plan: Plan, existing: Existing) -> None:
    """Rows an earlier run rejected because the job or the model failed on them
    (reasons.FAILURE_REASONS) are redone, not skipped as final: their rejects leave rejects/
    (where this run reads those rows again) and the run records them afresh if they fail
    again. Runs after the manifest is stashed: the folder reads as unfinished meanwhile."""
    if not set(existing.reject_reasons) & reasons.FAILURE_REASONS:
        return

    def rereads(source: str, row: int) -> bool:
        return ((plan.sources is None or source in plan.sources)
                and (plan.row_limits is None or row <= plan.row_limits.get(source, 0)))

    dropped = out.drop_failed_rejects(reasons.FAILURE_REASONS, rereads)
    # read back, not subtracted: a drop retried after a storage error returns only its
    # last attempt's keys
    existing.rejects, existing.reject_rows, existing.reject_reasons = out.rejects()
    if dropped:
        log.info("%d rows rejected as failures by an earlier run (%s) are redone",
                 len(dropped), ", ".join(sorted(reasons.FAILURE_REASONS)))


def run(cfg: JobConfig) -> dict:
    """Run the job and return its manifest. Raises ConfigError for unusable settings or
    input, AccountingError if rows were lost or duplicated, ErrorBudgetExceeded if more rows
    failed than cfg.max_error_share allows (no manifest in the last two cases)."""
    r = Run.begin(cfg)
    try:
        check_submitted_paths(cfg.input, cfg.output)  # relative paths under `ray job submit`
        r.out = Output(cfg.output)
        r.inputs = resolve_inputs(cfg.input, cfg.format)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_disjoint(r.inputs, r.out)
    r.out.check_target()  # storage first: refused keys or a missing bucket cost no model load
    # Load the tokenizer before Ray: a wrong --model fails now, with a plain message.
    from mist_core.models import check_reachable, resolve

    try:
        check_reachable(cfg.model)
        _, r.model_name = resolve(cfg.model)
        rows.template_for(cfg.model, cfg.template, cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(one_line(f"cannot load the tokenizer of --model {cfg.model}: {e}")
                          ) from None
    # One writer per output, from before the first write to after the manifest: a second
    # run refuses here, before it starts Ray (lease.py).
    held = lease.acquire(r.out, r.run_id)
    try:
        return _run(r, held)
    except BaseException:  # Ctrl-C included
        if r.own_ray:
            tidy_stopped(r.out, held)
        raise
    finally:
        held.release()


def tidy_stopped(out: Output, held) -> None:
    """A run stopped on its way (an error, the error budget, Ctrl-C) can leave a `_tmp-`
    file its write task was writing, or sft/ and scores/ files whose data/ file never came:
    a reader's glob (duckdb's 'rejects/*.parquet', the natural look after exit 5) fails on
    them until a rerun cleans. For a run on this process's own Ray: stop it first, so that
    no write task is left to finish a group, then delete them, if the output's lease is
    still this run's (one that lapsed may be another run's now). Once, without retries: in
    an outage the rerun does it."""
    ray.shutdown()
    try:
        with storage.once():
            held.check()
            removed = out.clean_partial()
    except Exception as e:  # noqa: BLE001 -- the run's own error is the one to report
        log.warning("the stopped run's partial files stay until the rerun: %s", one_line(e))
        return
    if removed:
        log.info("removed %d partial files of the stopped run", removed)


def _run(r: Run, held) -> dict:
    """run() once the output's lease is held."""
    cfg, out = r.cfg, r.out
    r.own_ray = runtime.init_ray(cfg.address, cfg.actors, cfg.cpus_per_actor, cfg.verbose)

    if cfg.mode == "overwrite":
        out.clear()
    removed = out.clean_partial()
    if removed:
        log.info("removed %d files left by an unfinished run", removed)
    r.existing = existing = out.load()
    check_compatible(cfg, r.model_name, existing, out)

    r.plan = plan = make_plan(r.inputs, cfg, existing)
    log.info("plan: %d rows read, %d to score, %d already in the output, %d invalid, "
             "%d repeated ids, %d examples in all (%.1fs)", plan.read, plan.to_score, plan.done,
             plan.invalid, plan.duplicates, plan.examples, plan.seconds)
    r.gpus = runtime.gpus_per_actor(cfg.gpus_per_actor)
    r.device = placement.resolve_device(cfg.device, r.gpus)  # --device cuda without GPUs: exit 2
    if r.gpus > 0 and plan.to_score and not ray.cluster_resources().get("GPU", 0):
        log.info("no GPU in the cluster yet: the scoring actors wait for the autoscaler to "
                 "add GPU nodes")

    out.stash_manifest()
    retry_failed_rows(out, plan, existing)
    budget = ErrorBudget(cfg.max_error_share, plan.examples)
    # The tally lets a write task stop the run as soon as the budget is spent. A run with
    # no rows to score, or a budget nothing can exceed, needs no actor: the end check does.
    tally = start_tally() if plan.to_score and budget.allowed < plan.examples else None
    sink = OutputSink(cfg, fs=out.fs, root=out.root, run_id=r.run_id, model=r.model_name,
                      extras=plan.extras, known_rejects=existing.rejects, budget=budget,
                      tally=tally)
    schema = data_schema(plan.extras)
    r.conformed = out.conform(schema)  # before the new files: data/ never holds three schemas
    if r.conformed:
        log.info("rewrote %d earlier data/ files with this run's new columns", r.conformed)
    if cfg.scores and out.conform(SCORES_SCHEMA, "scores"):  # from before facts_necessity
        log.info("rewrote the earlier scores/ files with this version's columns")
    stats = placement.start_stats(r.run_id) if plan.to_score else None  # the actors' records
    t_run = time.perf_counter()
    try:
        with placement.Progress(stats, plan.to_score, cfg.progress_interval):  # [progress]
            build(cfg, r.inputs, plan, existing, r.gpus, r.device, stats).write_datasink(sink)
    except Exception as e:
        if tally is not None and any(isinstance(c, ErrorBudgetExceeded) or
                                     "ErrorBudgetExceeded" in str(c) for c in causes(e)):
            seen, failed, first = ray.get(tally.totals.remote())
            raise ErrorBudgetExceeded(budget.message(failed, first, seen)) from None
        raise
    finally:
        if tally is not None:
            ray.kill(tally)
    r.run_s = time.perf_counter() - t_run
    r.actors = placement.collect(stats)
    out.ensure_files({"data": schema, "rejects": REJECT_SCHEMA,
                      **({"scores": SCORES_SCHEMA} if cfg.scores else {})})
    out.write_dataset_info(cfg.sft_format)

    r.totals = out.totals()
    r.stats = sink.stats
    reconcile(cfg, plan, sink.stats, existing, r.totals)
    if budget.exceeded(sink.stats.failures):  # the whole run's count, before any manifest
        raise ErrorBudgetExceeded(budget.message(sink.stats.failures, sink.stats.first_failure))
    manifest = r.manifest()
    held.check()  # the manifest is the lease holder's
    out.write_manifest(manifest)
    return manifest


def summary(manifest: dict, out: Output) -> str:
    c, t, tot = manifest["counts"], manifest["timings"], manifest["totals"]
    thr = manifest["throughput"]["chains_per_s"]
    n_budgets = len(tot["rows_per_budget"])
    lines = [
        f"MIST compression finished in {t['total_s']:.1f}s (run {manifest['run_id']}).",
        f"Outputs in {manifest['output']}:",
        f"  data/      {sum(tot['rows_per_budget'].values())} rows: {tot['examples']} examples x "
        f"{n_budgets} budget{'' if n_budgets == 1 else 's'} (parquet)",
        f"  sft/       {tot['sft_records']} training records "
        f"({manifest['config']['sft_format']} JSONL)",
        f"  rejects/   {tot['rejects']} rows that could not be used",
    ]
    if manifest["config"]["scores"]:
        lines.append("  scores/    per-token scores (parquet)")
    lines += [
        "  _manifest.json   settings, versions, counts, timings",
        f"This run: read {c['read']}"
        + (f" ({c['examples']} examples)" if c["examples"] != c["read"] else "")
        + f", scored {c['scored']}, rejected {c['rejected']}, "
        f"already done {c['already_done']}"
        + (f"; {thr:.2f} chains/s" if thr and c["scored"] else ""),
    ]
    if c["rejected_by_reason"]:
        lines.append("  rejected: " + ", ".join(f"{k} {v}" for k, v in c["rejected_by_reason"].items()))
    if tot["mean_kept_ratio"]:
        words = tot.get("mean_kept_word_ratio", {})
        lines.append("Mean kept share of the chain per budget, tokens / words: " + "  ".join(
            f"{b}: {r:.2f}" + (f" / {words[b]:.2f}" if b in words else "")
            for b, r in tot["mean_kept_ratio"].items()))
    budgets = manifest["config"]["budgets"]
    ex = out.example(min(budgets)) if budgets else None
    if ex:
        lines += [f"Example at budget {budget_label(ex['budget'])} ({ex['id']}, "
                  f"{ex['kept_tokens']}/{ex['cot_tokens']} tokens kept):",
                  f"  question:   {ex['question']}",
                  f"  chain:      {ex['cot']}",
                  f"  compressed: {ex['compressed_cot']}",
                  f"  answer:     {ex['answer']}"]
    return "\n".join(lines)


DESCRIPTION = """\
Compress reasoning chains with MIST, as a Ray Data job.

Reads corpora (JSONL or parquet, local or in object storage, or a Hugging Face split),
scores every chain with a model (one replica per actor; one GPU each on a GPU cluster),
prunes each chain to every budget, and writes under --output:
  data/     parquet, one row per (example, budget): the compressed chain and its counts
  sft/      JSONL training data mixing the budgets and the full chain
  scores/   per-token scores (with --scores)
  rejects/  every input row that could not be used, with its reason
  _manifest.json   written last: settings, versions, counts, timings

With no arguments it runs the built-in demo on this machine: 24 generated arithmetic
problems, SmolLM2-135M-Instruct, output in ./outputs/demo.
Running again onto the same --output (mode refresh) scores only rows not yet there."""

EPILOG = """\
examples:
  python -m pipelines.compress                       # the demo, end to end
  python -m pipelines.compress --input ../shared/data/gsm8k/test.jsonl --adapter gsm8k \\
      --output outputs/gsm8k --limit 100
  python -m pipelines.compress --input s3://bucket/corpora/math/ --adapter math \\
      --output s3://bucket/mist/math --model Qwen/Qwen2.5-1.5B-Instruct \\
      --actors 1,4 --gpus-per-actor 1 --scores
  python -m pipelines.compress --config refresh.yaml   # keys as below, e.g. batch_size: 32

exit status: 0 done, 2 bad settings, input or model, or another run writing the same
--output (its lease, <output>/_lease.json), 3 counts did not reconcile, 4 storage
unavailable (retried for MIST_STORAGE_RETRY_S seconds, default 60; rerun to resume),
5 more rows failed than --max-error-share allows (no manifest; rerun after the fix redoes
them), 130 interrupted (Ctrl-C; rerun to resume), 1 other failure."""


def parse_args(argv: list[str] | None = None, prog: str = "python -m pipelines.compress"
               ) -> JobConfig:
    """The job's settings from its command line (and the YAML file --config names)."""
    return parse(JobConfig, argv, prog, DESCRIPTION, EPILOG)


def main(argv: list[str] | None = None, prog: str = "python -m pipelines.compress") -> int:
    """`mist compress` (and `python -m pipelines.compress`): the compression job, then its
    summary.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for bad settings, input or a model that cannot load, 3 for
        counts that do not add up, 4 for storage that stayed unavailable, 5 for more failed
        rows than --max-error-share allows, 130 for Ctrl-C (pipelines.common.exits)."""
    exits.setup_logging()

    def body() -> int:
        cfg = parse_args(argv, prog)
        with runtime.console(cfg.verbose):
            manifest = run(cfg)
        print(summary(manifest, Output(cfg.output)), flush=True)
        return 0

    return exits.run_main(body, interrupted=INTERRUPTED)


INTERRUPTED = ("interrupted (Ctrl-C) before the run finished; the file groups it committed "
               "stay: rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
