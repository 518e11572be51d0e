"""The compression job's overhead: its throughput on a corpus ÷ a bare in-process loop doing
the same work (tokenize, score, prune) with the same model and settings. Called by
`python -m pipelines.bench --pipeline`.

Both sides are timed end to end, model loading included; the job's time also includes
starting Ray, its planning pass and writing the output. The steady-state ratio sets the bare
loop's scoring time against the streaming part of the run (read, tokenize, score, prune,
write, all overlapped)."""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from mist_core import MistScorer, get_adapter, load_model, prune

from . import compress
from .settings import JobConfig, validate


def _rows(path: Path, n: int) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def bare_loop(args, rows: list[dict], budgets: list[float]) -> tuple[float, float]:
    """(seconds end to end, seconds scoring) of the same work in one process."""
    t0 = time.perf_counter()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    scorer = MistScorer(lm, max_tokens=args.batch_tokens, max_batch=args.batch_size)
    adapt = get_adapter("gsm8k")
    examples = [adapt(r) for r in rows]
    encoded = [scorer.encode(e) for e in examples]
    t1 = time.perf_counter()
    scored = scorer.score_encoded(encoded)
    t2 = time.perf_counter()
    for ex, s in zip(examples, scored):
        prune(ex, s, budgets=budgets, unit="word")
    return time.perf_counter() - t0, t2 - t1


def job(cfg) -> tuple[float, dict]:
    """(seconds end to end, manifest) of one run of the job, on the fresh local Ray it
    starts for itself as a user's run does."""
    t0 = time.perf_counter()
    try:
        manifest = compress.run(cfg)
    finally:
        ray.shutdown()
    return time.perf_counter() - t0, manifest


def pipeline_over_bare(args) -> dict:
    """Bare loop and job alternately, `args.repeats` times each (CPU timings drift over
    minutes; alternating exposes both to the same drift), compared by their medians."""
    if ray.is_initialized():
        raise RuntimeError("the pipeline benchmark starts its own local Ray: call it with none running")
    threads = args.threads or 2
    rows = _rows(Path(args.corpus), args.chains)
    bare, bare_scoring, runs, steady = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="mist-bench-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = validate(JobConfig(input=[str(corpus)], adapter="gsm8k", output=str(Path(tmp) / "out"),
                                 model=args.model, dtype=args.dtype, mode="overwrite",
                                 batch_tokens=args.batch_tokens, batch_size=args.batch_size,
                                 actors=(1, 1), cpus_per_actor=threads, gpus_per_actor=0))
        for _ in range(max(1, args.repeats)):
            total, scoring = bare_loop(args, rows, cfg.budgets)
            bare.append(total)
            bare_scoring.append(scoring)
            seconds, manifest = job(cfg)
            scored = manifest["counts"]["scored"]
            if scored != len(rows):
                raise RuntimeError(f"the job scored {scored} of {len(rows)} chains: {manifest['counts']}")
            runs.append(seconds)
            steady.append(manifest["timings"]["run_s"])
    med = statistics.median
    return {"pipeline_chains": len(rows), "pipeline_repeats": len(runs),
            "bare_s": med(bare), "bare_scoring_s": med(bare_scoring), "job_s": med(runs),
            "job_run_s": med(steady), "bare_s_all": bare, "job_s_all": runs,
            "pipeline_over_bare": med(bare) / med(runs),
            "pipeline_steady_over_bare_scoring": med(bare_scoring) / med(steady)}
