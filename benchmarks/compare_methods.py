"""Two methods of one evaluation run (pipelines.evaluation.evaluate's results.jsonl), compared chain by
chain: the mean difference A − B of each measure at each budget, with a 95% percentile
bootstrap interval over chains (the same draws for every measure). Needs no model.

    python benchmarks/compare_methods.py docs/results/runs/gsm8k_layer_weights mist_clipped mist

Measures: Eq. 1 (log p(a | x, c'), nats), retention ((LL(c') − LL(∅)) / (LL(c) − LL(∅))),
answer accuracy, and the share of the chain's intermediate results kept."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mist_core.measures.stats import bootstrap_indices, ci_mean  # noqa: E402
from pipelines.evaluation.results import RESULTS, read_records  # noqa: E402


def measure(rec: dict, variant: dict, name: str) -> float:
    if name == "eq1":
        return variant["ll"]
    if name == "retention":
        span = rec["ll_full"] - rec["ll_nochain"]
        return (variant["ll"] - rec["ll_nochain"]) / span if abs(span) > 1e-6 else np.nan
    if name == "accuracy":
        return float(variant["correct"])
    return variant["results"] / rec["chain"]["results"] if rec["chain"]["results"] else np.nan


def main(run: str, a: str, b: str) -> str:
    folder = Path(run)
    path = folder / RESULTS if (folder / RESULTS).exists() else folder / (RESULTS + ".gz")
    recs = [r for r in read_records(path) if r.get("status") == "ok"]
    budgets = sorted({k.split("@")[1] for r in recs for k in r["variants"] if k.startswith(a + "@")})
    idx = bootstrap_indices(len(recs))
    lines = [f"{a} − {b}, {len(recs)} chains of {run}, mean [95% bootstrap interval]", "",
             "| γ | Eq. 1, nats | retention, points | accuracy, points | results kept, points |",
             "|---|---|---|---|---|"]
    for g in budgets:
        cells = []
        for name, scale in (("eq1", 1), ("retention", 100), ("accuracy", 100), ("results", 100)):
            d = np.array([measure(r, r["variants"][f"{a}@{g}"], name)
                          - measure(r, r["variants"][f"{b}@{g}"], name) for r in recs])
            m, lo, hi = ci_mean(d, idx)
            cells.append(f"{m * scale:+.2f} [{lo * scale:+.2f}, {hi * scale:+.2f}]")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    print(main(*sys.argv[1:]))
