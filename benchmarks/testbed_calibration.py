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
from pipelines.loop.testbed import ORACLES, _fmt, meets_bar, oracle_shares  # noqa: E402


READING = "## Reading"


def recipe(sizes: dict) -> str:
    return f"mix {sizes.get('mix', 'sample')}, {sizes['ft_epochs']:g} epochs, lr {sizes['ft_lr']:g}, " \
           f"unit {sizes.get('unit', 'token')}, corpus {sizes.get('phase0', 1000)}"


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
            r = oracle_shares(run["seeds"], arm)
            if not r["0.5"]["seeds"]:
                continue
            met = meets_bar(r)
            lines.append(f"| {recipe(run['sizes'])} | {arm} | {r['0.5']['seeds']} | {_fmt(r['0.5']['acc_share'], 100)}% | "
                         f"{_fmt(r['0.5']['token_share'], 100)}% | {_fmt(r['0.7']['acc_share'], 100)}% | "
                         f"{_fmt(r['0.7']['token_share'], 100)}% | {_fmt(r['1.0']['vs_full'], 100)} | "
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
