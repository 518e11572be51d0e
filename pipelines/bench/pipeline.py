"""The compression job's overhead: its throughput on a corpus ÷ a bare in-process loop doing
the same work (tokenize, score, prune) with the same model and settings. Called by
`mist bench --pipeline`.

Both sides are timed end to end, model loading included; the job runs as a user runs it,
`python -m pipelines.compress` in a process of its own, so its time also includes starting
Python and Ray, its planning pass and writing the output. The steady-state ratio sets the bare
loop's scoring time against the streaming part of the run (read, tokenize, score, prune,
write, all overlapped)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mist_core import MistScorer, get_adapter, load_model, prune

from ..common.settings import DEFAULT_BUDGETS  # the job's runs here use its default budgets

ROOT = Path(__file__).resolve().parents[2]


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


def job(flags: list[str], out: Path) -> tuple[float, dict]:
    """(seconds end to end, manifest) of one run of the job's command, on the fresh local
    Ray it starts for itself."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipelines.compress", *flags], cwd=ROOT,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"the job failed (exit {proc.returncode}): " + " | ".join(tail))
    return seconds, json.loads((out / "_manifest.json").read_text())


def pipeline_over_bare(args) -> dict:
    """Bare loop and job alternately, `args.repeats` times each (CPU timings drift over
    minutes; alternating exposes both to the same drift), compared by their medians."""
    threads = args.threads or 2
    rows = _rows(Path(args.corpus), args.chains)
    bare, bare_scoring, runs, steady = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="mist-bench-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = Path(tmp) / "out"
        flags = ["--input", str(corpus), "--adapter", "gsm8k", "--output", str(out),
                 "--model", args.model, "--dtype", args.dtype, "--mode", "overwrite",
                 "--batch-tokens", str(args.batch_tokens), "--batch-size", str(args.batch_size),
                 "--actors", "1", "--cpus-per-actor", str(threads), "--gpus-per-actor", "0"]
        for _ in range(max(1, args.repeats)):
            total, scoring = bare_loop(args, rows, DEFAULT_BUDGETS)
            bare.append(total)
            bare_scoring.append(scoring)
            seconds, manifest = job(flags, out)
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
