"""A saliency picture of one chain: its tokens shaded by necessity, sufficiency and the
unified MIST score, and what each budget keeps, as HTML (hover a token for its numbers)
and PNG.

    mist saliency --input ../shared/data/gsm8k/test.jsonl --adapter gsm8k \\
        --row 1 --out docs/results

The chain is read with the compression job's reader and adapter (any of its inputs; --row
is the 1-based row number within its source) and scored in this process."""
from __future__ import annotations

import html
import shlex
import sys
from pathlib import Path

import numpy as np

from mist_core.data.formats import budget_label
from mist_core.scoring.prune import UNITS

from ..common import exits, page
from ..common.errors import ConfigError
from ..common.rows import parse_row
from ..common.settings import Chains, Corpus, Model, parse, positive, setting

ROWS = ("necessity", "sufficiency", "unified")
CMAPS = {"necessity": "Reds", "sufficiency": "Blues", "unified": "Purples"}


def read_example(inputs: list[str], adapter: str, columns: dict, row: int, fmt: str = "auto"):
    """The example at 1-based `row` of the first source, read as the job reads."""
    import pyarrow.compute as pc
    import ray

    from ..common.sources import read_raw, resolve_inputs

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    found = read_raw(resolve_inputs(inputs, fmt)).map_batches(
        lambda t: t.filter(pc.equal(t["row"], row)), batch_format="pyarrow").take_all()
    if not found:
        raise ConfigError(f"no row {row} in {inputs}")
    ex, _ = parse_row(sorted(found, key=lambda r: r["source"])[0]["raw"], adapter, columns)
    return ex


def chain_view(lm, ex, budgets: list[float], alpha: float = 0.6, unit: str = "token",
               template: str = "auto") -> dict:
    """Everything the picture shows: token pieces, the three scores as within-chain
    percentiles (what the shading encodes) and raw, and each budget's kept mask."""
    from mist_core import MistScorer, prune
    from mist_core.scoring.prune import token_pieces
    from mist_core.scoring.scorer import combine

    scorer = MistScorer(lm, alpha=alpha, template=template)
    enc = scorer.encode(ex)
    [s] = scorer.score_encoded([enc])
    raw = {"necessity": combine(s.necessity, None, alpha),
           "sufficiency": combine(None, s.sufficiency, alpha), "unified": s.scores}
    T = len(s.scores)
    shade = {k: (np.argsort(np.argsort(v, kind="stable"), kind="stable") / max(T - 1, 1))
             for k, v in raw.items()}
    kept = {c.budget: c.kept for c in prune(ex, s, budgets=budgets, unit=unit)}
    return {"pieces": token_pieces(ex.cot, s.chain_offsets), "raw": raw, "shade": shade,
            "kept": kept, "example": ex, "model": lm.name, "alpha": alpha, "unit": unit}


def _rgba(cmap: str, x: float) -> str:
    import matplotlib

    r, g, b, _ = matplotlib.colormaps[cmap](0.08 + 0.8 * float(x))
    return f"rgb({int(255 * r)},{int(255 * g)},{int(255 * b)})"


def render_html(view: dict, caption: str) -> str:
    ex = view["example"]
    out = ["<!doctype html><meta charset='utf-8'><title>MIST saliency</title>",
           f"<style>{page.STYLE}span[title]{{border-radius:2px}}</style>",
           "<h1>What MIST sees in one chain</h1>",
           f"<p>{html.escape(caption)}</p>",
           f"<p><b>Question.</b> {html.escape(ex.question)}<br><b>Answer.</b> {html.escape(ex.answer)}</p>",
           "<p>Shading: each token's rank within the chain (darker = higher). Hover a token "
           "for its normalised scores (necessity: z of log|φ̂|; sufficiency: z of ψ̂; "
           f"unified: S = α·necessity + (1−α)·sufficiency, α = {view['alpha']}).</p>"]
    pieces = view["pieces"]

    def title(i):
        return " ".join(f"{k} {view['raw'][k][i]:+.2f}" for k in ROWS)

    for row in ROWS:
        spans = "".join(f"<span title='{title(i)}' style='background:{_rgba(CMAPS[row], view['shade'][row][i])}'>"
                        f"{html.escape(p)}</span>" for i, p in enumerate(pieces))
        out += [f"<h3>{row}</h3>", f"<div class='c'>{spans}</div>"]
    for b, kept in view["kept"].items():
        spans = "".join(f"<span class='{'k' if k else 'd'}' title='{title(i)}'>{html.escape(p)}</span>"
                        for i, (p, k) in enumerate(zip(pieces, kept)))
        out += [f"<h3>kept at γ = {budget_label(b)} ({int(kept.sum())} of {len(kept)} tokens)</h3>",
                f"<div class='c'>{spans}</div>"]
    return "\n".join(out) + "\n"


def _layout(pieces: list[str], width: int) -> list[tuple[int, int, str]]:
    """(line, column, text) of each token piece, wrapping at `width` characters; a newline
    inside a piece starts a new line."""
    line, col, out = 0, 0, []
    for p in pieces:
        parts = p.split("\n")
        for j, part in enumerate(parts):
            if j:
                line, col = line + 1, 0
            if col + len(part) > width and col:
                line, col = line + 1, 0
                part = part.lstrip()
            out.append((line, col, part))
            col += len(part)
    return out


def render_png(view: dict, caption: str, path: Path, width: int = 110) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    font = 8.0
    char_in = 0.6021 * font / 72  # DejaVu Sans Mono's advance: 0.602 em
    line_in = 1.55 * font / 72
    pieces = [p.replace("\t", " ") for p in view["pieces"]]
    cells = _layout(pieces, width)
    owners = []  # token index of each cell
    for i, p in enumerate(pieces):
        owners += [i] * len(p.split("\n"))
    n_lines = cells[-1][0] + 1 if cells else 1
    width = max(60, max((col + len(t) for _, col, t in cells), default=0))  # no empty margin
    panels = [(r, None) for r in ROWS] + [(None, b) for b in view["kept"]]
    panel_in = (n_lines + 1.6) * line_in
    W = width * char_in + 0.5
    H = len(panels) * panel_in + 1.2
    fig = plt.figure(figsize=(W, H))
    for k, (row, budget) in enumerate(panels):
        top = H - 0.45 - k * panel_in
        ax = fig.add_axes([0.25 / W, (top - panel_in + 0.1) / H, width * char_in / W,
                           (panel_in - 0.1) / H])
        ax.set_xlim(0, width)
        ax.set_ylim(n_lines + 1.2, 0)
        ax.axis("off")
        if row:
            label = f"{row} (darker = ranked higher in this chain)"
        else:
            kept = view["kept"][budget]
            label = f"kept at γ = {budget_label(budget)}: {int(kept.sum())} of {len(kept)} tokens"
        ax.text(0, 0.45, label, fontsize=font + 1, weight="bold", va="center")
        for (line, col, text), i in zip(cells, owners):
            if not text:
                continue
            y = line + 1.6
            if row:
                color = matplotlib.colormaps[CMAPS[row]](0.08 + 0.8 * view["shade"][row][i])
                ax.add_patch(plt.Rectangle((col, y - 0.5), len(text), 1.0, color=color, lw=0))
                fg = "white" if view["shade"][row][i] > 0.75 else "black"
            else:
                on = bool(view["kept"][budget][i])
                if on:
                    ax.add_patch(plt.Rectangle((col, y - 0.5), len(text), 1.0, color="#b9e4b9", lw=0))
                fg = "black" if on else "#b0b0b0"
            ax.text(col, y, text, family="DejaVu Sans Mono", fontsize=font, va="center",
                    ha="left", color=fg)
    import textwrap

    fig.text(0.25 / W, 0.08 / H, textwrap.fill(caption, int(width * 1.25)), fontsize=6.5,
             color="#444444", va="bottom")
    fig.savefig(path, dpi=130)
    plt.close(fig)


class SaliencyConfig(Chains, Model, Corpus):
    """`mist saliency`'s settings: one chain of a corpus, scored and pruned as the job does."""

    row: int = setting(1, "1-based row of the chain in the first input", group="input",
                       metavar="N")
    budgets: list[float] = setting([0.3, 0.5, 0.7, 0.9], "retention budgets γ, comma-separated",
                                   group="scoring", metavar="LIST")
    unit: str = setting("token", "the pruning unit", group="scoring", choices=UNITS)
    out: str = setting("docs/results", "folder for saliency.html and saliency.png",
                       group="output", metavar="DIR")

    _positive = positive("row")


def main(argv: list[str] | None = None, prog: str = "mist saliency") -> int:
    """`mist saliency`: the saliency page and picture of one chain.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for bad settings or a row that is not there."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return exits.run_main(lambda: draw(parse(SaliencyConfig, argv, prog,
                                             __doc__.split("\n\n")[0]), argv))


def draw(a: SaliencyConfig, argv: list[str]) -> int:
    from mist_core import load_model

    ex = read_example(a.input, a.adapter, a.columns, a.row, a.format)
    lm = load_model(a.model, dtype=a.dtype)
    view = chain_view(lm, ex, a.budgets, a.alpha, a.unit, a.template)
    caption = (f"model {lm.name}; corpus {', '.join(a.input)} ({a.adapter}), row {a.row} "
               f"(id {ex.key}); unit {a.unit}, α = {a.alpha}; command: mist saliency "
               + shlex.join(argv))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "saliency.html").write_text(render_html(view, caption), encoding="utf-8")
    render_png(view, caption, out / "saliency.png")
    print(f"wrote {out / 'saliency.html'} and {out / 'saliency.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
