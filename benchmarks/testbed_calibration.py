"""The testbed's calibration: for each recipe (a testbed run's testbed.json), does the
oracle arm meet the bar before any method is compared?

    python benchmarks/testbed_calibration.py /tmp/calA /tmp/calB ... --out docs/results/calibration.md
    python benchmarks/testbed_calibration.py /tmp/calC --append --out docs/results/calibration.md

The bar (issue 29): the oracle at γ = 0.5 keeps ≥ 90% of the full-chain control's accuracy
while writing ≤ 60% of its chain tokens, and the mixture costs ≤ 3 points at γ = 1.0 (the
oracle's model asked for the full chain against the full-chain control). Needs no model."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipelines.loop.testbed import t_interval  # noqa: E402


READING = "## Reading"
# the ceiling arms: random fill, the nearest tokens, and with the writer's cues
ORACLES = ("oracle", "oracle_near", "oracle_cue")


def recipe(sizes: dict) -> str:
    return f"mix {sizes.get('mix', 'sample')}, {sizes['ft_epochs']:g} epochs, lr {sizes['ft_lr']:g}, " \
           f"unit {sizes.get('unit', 'token')}, corpus {sizes.get('phase0', 1000)}"


def rows(run: dict, arm: str = "oracle") -> dict:
    """Per γ: the oracle's accuracy share of the full-chain control, its chain-token share,
    and the mixture's cost at 1.0, as (mean, half-width) over the run's seeds."""
    out = {}
    seeds = [s for s in run["seeds"].values() if arm in s.get("arms", {})]
    for g in ("0.5", "0.7", "1.0"):
        acc, tok, full_acc = [], [], []
        for s in seeds:
            full = s["arms"]["full_chain"]["budgets"]["1.0"]
            got = s["arms"][arm]["budgets"].get(g)
            if got is None:
                continue
            acc.append(got["accuracy"] / full["accuracy"])
            tok.append(got["chain_tokens"] / full["chain_tokens"])
            full_acc.append(got["accuracy"] - full["accuracy"])
        out[g] = {"acc_share": t_interval(acc), "token_share": t_interval(tok),
                  "vs_full": t_interval(full_acc), "seeds": len(acc)}
    return out


def fmt(mi, scale=100.0) -> str:
    m, h = mi
    return f"{m * scale:.1f}" + ("" if h != h else f" ± {h * scale:.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="testbed --out folders (each with testbed.json)")
    p.add_argument("--out", default=None, help="write the table here (markdown)")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in --out's table (runs no longer at hand)")
    a = p.parse_args(argv)
    lines = ["| recipe | arm | seeds | acc. / full-chain, γ = 0.5 | chain tokens / full-chain, 0.5 "
             "| acc. / full, 0.7 | tokens / full, 0.7 | arm at 1.0 − full-chain, points | bar met |",
             "|---|---|---|---|---|---|---|---|---|"]
    for folder in a.runs:
        run = json.loads((Path(folder) / "testbed.json").read_text())
        for arm in ORACLES:
            r = rows(run, arm)
            if not r["0.5"]["seeds"]:
                continue
            met = (r["0.5"]["acc_share"][0] >= 0.9 and r["0.5"]["token_share"][0] <= 0.6
                   and (r["1.0"]["seeds"] == 0 or r["1.0"]["vs_full"][0] >= -0.03))
            lines.append(f"| {recipe(run['sizes'])} | {arm} | {r['0.5']['seeds']} | {fmt(r['0.5']['acc_share'])}% | "
                         f"{fmt(r['0.5']['token_share'])}% | {fmt(r['0.7']['acc_share'])}% | "
                         f"{fmt(r['0.7']['token_share'])}% | {fmt(r['1.0']['vs_full'])} | "
                         f"{'yes' if met else 'no'} |")
    text = "\n".join(lines) + "\n"
    if a.out:
        out = Path(a.out)
        old = out.read_text() if out.exists() else ""
        # the page above the table (all of it before the reading where there is no table yet)
        head = (old[:old.index("| recipe |")] if "| recipe |" in old
                else old[:old.index(READING)] if READING in old else old)
        if a.append and "| recipe |" in old:  # the old rows, then this call's
            kept = [ln for ln in old[old.index("| recipe |"):].splitlines()[2:]
                    if ln.startswith("| ")]
            text = "\n".join(lines[:2] + kept + lines[2:]) + "\n"
        tail = old[old.index(READING):] if READING in old else ""  # written by hand, kept
        out.write_text(head + text + ("\n" + tail if tail else ""))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
