"""The compression job's overhead: its throughput on a corpus ÷ a bare in-process loop doing
the same work (tokenize, score, prune) with the same model and settings. Called by
`python -m pipelines.bench --pipeline`.

Both sides are timed end to end, model loading included; the job's time also includes
starting Ray, its planning pass and writing the output. The job's steady rate (rows scored ÷
the streaming part of the run) is reported beside it."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import ray

from mist_core import MistScorer, get_adapter, load_model, prune

from . import compress
from .config import JobConfig, validate


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


def pipeline_over_bare(args) -> dict:
    if ray.is_initialized():
        raise RuntimeError("the pipeline benchmark starts its own local Ray: call it with none running")
    threads = args.threads or 2
    rows = _rows(Path(args.corpus), args.chains)
    with tempfile.TemporaryDirectory(prefix="mist-bench-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = validate(JobConfig(input=[str(corpus)], adapter="gsm8k", output=str(Path(tmp) / "out"),
                                 model=args.model, dtype=args.dtype, mode="overwrite",
                                 batch_tokens=args.batch_tokens, batch_size=args.batch_size,
                                 actors=(1, 1), cpus_per_actor=threads, gpus_per_actor=0))
        bare_s, bare_score_s = bare_loop(args, rows, cfg.budgets)
        # One logical CPU more than the actor takes, for the read/tokenize/prune tasks; the
        # machine's cores are shared by both, as in the bare loop.
        t0 = time.perf_counter()
        ray.init(address="local", num_cpus=threads + 1, include_dashboard=False)
        try:
            manifest = compress.run(cfg)
        finally:
            ray.shutdown()
        job_s = time.perf_counter() - t0
    scored = manifest["counts"]["scored"]
    if scored != len(rows):
        raise RuntimeError(f"the job scored {scored} of {len(rows)} chains: {manifest['counts']}")
    return {"pipeline_chains": scored, "bare_s": bare_s, "job_s": job_s,
            "job_run_s": manifest["timings"]["run_s"],
            "pipeline_over_bare": bare_s / job_s,
            "pipeline_steady_over_bare_scoring": bare_score_s / manifest["timings"]["run_s"]}
