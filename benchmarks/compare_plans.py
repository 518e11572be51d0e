"""Two ways of running the same long chain, alternating with a plain forward, in one
process: the plan the scorer picks under a memory cap against another plan given by hand.
Machine drift hits both alike, so the medians' ratio is what to read. It runs as the job's
CPU model actors do (mist_core.scoring.allocator.cpu_scoring_env), starting itself again with that
environment where the shell has not set it.

    .venv/bin/python benchmarks/compare_plans.py --tokens 7680 --max-memory 1GB \
        --other "Plan(recompute=True, mlp_pieces=True, keep_every=6)" --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mist_core import MistScorer, load_model  # noqa: E402
from mist_core.scoring.allocator import cpu_scoring_env  # noqa: E402
from mist_core.scoring.passes import Plan  # noqa: E402
from pipelines.bench.long import long_chain  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--max-memory", default="1GB")
    p.add_argument("--other", default="Plan(recompute=True)", help="a Plan(...) expression")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    env = cpu_scoring_env()
    if any(os.environ.get(k) != v for k, v in env.items()):  # torch reads it at its first allocation
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="float32", device="cpu")
    enc = long_chain(lm, args.tokens)
    ids = torch.tensor(enc.source_ids)[None]
    plans = {"picked": MistScorer(lm, max_memory=args.max_memory).plan([enc]),
             "other": eval(args.other, {"Plan": Plan})}
    print(plans, flush=True)

    def forward():
        with torch.no_grad():
            lm.model(input_ids=ids, use_cache=False)

    def score(plan):
        scorer = MistScorer(lm, max_memory=None)
        scorer.plan = lambda batch: plan
        scorer.score_encoded([enc])

    forward()
    runs = {"forward": [], "picked": [], "other": []}
    for _ in range(args.repeats):
        for name in ("picked", "other"):
            for key, fn in (("forward", forward), (name, lambda: score(plans[name]))):
                t = time.perf_counter()
                fn()
                runs[key].append(time.perf_counter() - t)
            print({k: [round(x, 1) for x in v] for k, v in runs.items()}, flush=True)
    f = statistics.median(runs["forward"])
    out = {"model": args.model, "tokens": len(enc.source_ids), "chain_tokens": args.tokens,
           "max_memory": args.max_memory, "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"),
           "plans": {k: repr(v) for k, v in plans.items()},
           "runs": runs, "forward_equivalents": {k: statistics.median(runs[k]) / f
                                                 for k in ("picked", "other")}}
    print(json.dumps(out["forward_equivalents"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
