"""`mist solve`: a model answers a test set greedily under each budget γ (the directive the
SFT records carry below γ = 1.0), in a Ray Data actor pool, and the answers are scored: the
last step of the distillation loop (generate, compress, train, solve).

OUT gets results.jsonl (one row per question and γ: id, budget, question, gold answer,
prediction, answer_line, correct, chain_tokens, tokens, finished, completion) and
summary.json (per γ: accuracy, mean chain tokens and achieved compression, the mean chain
tokens at γ ÷ at γ = 1.0 over the same questions, each with a 95% bootstrap interval,
beside the requested γ), and the table is printed. Answers are read by
generation.read_answer: the `The answer is ` line, else the last number (gsm8k) or \\boxed{}
(math); `answer_line` says which. A rerun replaces both files."""
from __future__ import annotations

import sys
import time

import pyarrow as pa
from pydantic import field_validator

from . import base as loop
from ..common import runtime, storage
from ..common.settings import check_budgets, parse, positive, setting

RESULT_SCHEMA = pa.schema([
    ("id", pa.string()), ("budget", pa.float64()), ("question", pa.string()),
    ("answer", pa.string()), ("prediction", pa.string()), ("answer_line", pa.bool_()),
    ("correct", pa.bool_()), ("chain_tokens", pa.int64()), ("tokens", pa.int64()),
    ("finished", pa.bool_()), ("completion", pa.string()),
])


class SolveActor:
    """One model replica; answers each question of a batch under every budget."""

    def __init__(self, *, model: str, dtype: str, device: str, threads: int | None,
                 budgets: list[float], style: str, max_new_tokens: int, batch_size: int,
                 trust_remote_code: bool = False):
        self.lm = loop.load_lm(model, dtype, device, threads, trust_remote_code)
        self.budgets, self.style = budgets, style
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size

    def __call__(self, batch: pa.Table) -> pa.Table:
        from mist_core.distill.generation import solve

        rows = batch.to_pylist()
        by_id = {r["id"]: r for r in rows}
        out = []
        for budget in self.budgets:
            for res in solve(self.lm, rows, budget=budget, style=self.style,
                             max_new_tokens=self.max_new_tokens, batch_size=self.batch_size):
                src = by_id[res["id"]]
                out.append({**res, "question": src["question"], "answer": src["answer"]})
        return pa.Table.from_pylist(out, schema=RESULT_SCHEMA)


def run(args: SolveConfig) -> int:
    from mist_core.distill.generation import summarize, summary_table
    from mist_core.models import resolve

    t0 = time.perf_counter()
    st = loop.start(args)
    name, style, questions, qcounts = st.name, st.style, st.questions, st.counts
    pool, resources, device = st.pool, st.resources, st.device
    print(f"solving {len(questions)} questions at γ = {', '.join(f'{b:g}' for b in args.budgets)} "
          f"with {name} on {device} ({style} answers)", flush=True)
    import ray

    t_run = time.perf_counter()
    ds = ray.data.from_items(questions).map_batches(
        SolveActor, compute=pool, batch_size=args.batch_size, batch_format="pyarrow",
        fn_constructor_kwargs=dict(
            model=args.model, dtype=args.dtype, device=device, threads=int(args.cpus_per_actor),
            budgets=args.budgets, style=style, max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, trust_remote_code=args.trust_remote_code),
        **resources)
    results = []
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        results += batch.to_pylist()
        print(f"[solve] {len(results)}/{len(questions) * len(args.budgets)} answers", flush=True)
    results.sort(key=lambda r: (r["budget"], r["id"]))
    summary = summarize(results, n_boot=args.n_boot, seed=args.seed)
    loop.write_rows(storage.join(args.output, "results.jsonl"), results)
    loop.write_json(storage.join(args.output, "summary.json"), {
        "command": "mist solve", "output": storage.redact(args.output), "summary": summary,
        "settings": {"input": [storage.redact(u) for u in args.input], "adapter": args.adapter,
                     "columns": args.columns, "limit": args.limit, "style": style,
                     "budgets": args.budgets, "max_new_tokens": args.max_new_tokens,
                     "n_boot": args.n_boot, "seed": args.seed},
        "model": {"spec": args.model, "name": name, "path": resolve(args.model)[0],
                  "dtype": args.dtype, "device": device,
                  "trust_remote_code": args.trust_remote_code},
        "counts": {**qcounts, "answers": len(results)},
        "versions": runtime.versions(),
        "timings": {"solve_s": round(time.perf_counter() - t_run, 3),
                    "total_s": round(time.perf_counter() - t0, 3)}})
    print(f"{name} on {len(questions)} questions (compression: mean chain tokens at γ ÷ at γ=1, "
          "95% bootstrap intervals):")
    print(summary_table(summary))
    print(f"results: {storage.redact(storage.join(args.output, 'results.jsonl'))}, "
          f"summary: {storage.redact(storage.join(args.output, 'summary.json'))}")
    return 0


class SolveConfig(loop.Questions):
    """`mist solve`'s settings."""

    budgets: list[float] = setting(
        [0.5, 0.7, 1.0], "budgets γ to ask for; 1.0 (no directive) is the baseline that "
        "achieved compression is measured against", group="scoring", metavar="LIST")
    n_boot: int = setting(2000, "bootstrap draws", group="statistics", metavar="N")
    seed: int = setting(0, "bootstrap seed", group="statistics")

    _budgets = field_validator("budgets", mode="before")(
        classmethod(lambda cls, v: check_budgets(v)))
    _positive = positive("n_boot")


EPILOG = """\
example:
  mist solve --input ../shared/data/gsm8k/test.jsonl --adapter gsm8k --limit 200 \\
      --model outputs/model --budgets 0.5,0.7,1.0 --output outputs/solve
"""


def parse_args(argv: list[str] | None, prog: str) -> SolveConfig:
    return parse(SolveConfig, argv, prog, __doc__.split("\n\n")[0], EPILOG)


def main(argv: list[str] | None = None, prog: str = "mist solve") -> int:
    """`mist solve`: answer a test set greedily under each budget and print the accuracy table.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for bad settings, input or a model that cannot load, 4 for
        storage that stayed unavailable (pipelines.common.exits)."""
    return loop.run_main(run, sys.argv[1:] if argv is None else list(argv), parse_args, prog)


if __name__ == "__main__":
    sys.exit(main())
