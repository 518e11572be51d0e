"""`mist show OUTPUT`: a look at a compression output without opening its parquet files by
hand. It prints the manifest's headline, the mean kept share per budget, the reject reasons
with their counts, and a few examples side by side: the original chain, then each budget's
compressed chain with the words it dropped marked ([-like this-], or dimmed on a terminal).
--html writes the same as a page in the style of the saliency view (pipelines/evaluation/saliency.py).

    mist show outputs/demo
    mist show s3://bucket/mist/gsm8k --rows 3 --html preview.html

The output is read, never written, through the job's storage (local paths, s3://, gs://):
the manifest, then data/ file by file until the examples are found, and rejects/' reasons.
Which characters a budget dropped is found by aligning the compressed chain with the
original (pruning keeps original pieces in order, so the compressed chain is a subsequence
of it); data/ stores no mask."""
from __future__ import annotations

import difflib
import html
import json
import os
import re
import shutil
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mist_core.data.formats import DATA_COLUMNS, budget_label

from ..common import exits, page, storage
from ..common.settings import Kit, parse, positive, setting

# The name pipelines/job/output.py writes (not imported from there: it pulls in Ray).
MANIFEST = "_manifest.json"
# Private-use marks around dropped text until it is rendered, two characters like [- and -]
# so that lines wrap at the width they print at.
DROP, END = "\ue000\ue000", "\ue001\ue001"
DIM, UNDIM = "\x1b[2m", "\x1b[22m"


@dataclass
class Preview:
    """What `mist show` prints, read from one output folder."""

    output: str  # the URI, without any user:password@ part
    manifest: dict | None  # None: no run has finished there (or one is under way)
    examples: list[list[dict]]  # the data/ rows of each example shown, by budget
    totals: dict  # the manifest's totals: rows_per_budget, mean_kept_ratio, …
    rejects: list[tuple[str, int, str]] = field(default_factory=list)  # reason, rows, a detail


def load(uri: str, rows: int = 2, ids: list[str] | None = None) -> Preview:
    """Read what the preview shows from an output folder.

    Args:
        uri: the job's --output (a local path, s3://… or gs://…).
        rows: how many examples to show (the first ones in data/), when `ids` is empty.
        ids: the ids of the examples to show instead.

    Returns:
        The Preview. Raises FileNotFoundError if the folder holds no data/ files."""
    fs, root, prefix = storage.filesystem(uri)
    text = storage.read_text(fs, storage.join(root, MANIFEST))
    manifest = json.loads(text) if text else None
    files = [p for p in storage.list_files(fs, storage.join(root, "data")) if p.endswith(".parquet")]
    if not files:
        raise FileNotFoundError(f"no data/ files under {storage.redact(prefix + root)}: "
                                "not a compression output, or its first run wrote nothing yet")
    if manifest is not None:
        totals = manifest["totals"]
    else:  # an unfinished run: count what is there (imported here: it pulls in Ray)
        from .output import Output

        totals = Output(uri).totals()
    return Preview(output=storage.redact(prefix + root), manifest=manifest,
                   examples=_examples(fs, files, rows, ids), totals=totals,
                   rejects=_rejects(fs, storage.join(root, "rejects")))


def _examples(fs, files: list[str], rows: int, ids: list[str] | None) -> list[list[dict]]:
    """The rows of the first `rows` examples (or of `ids`), reading files in name order and
    stopping once they are found: an output can hold millions of chains."""
    wanted = list(dict.fromkeys(ids or []))
    found: dict[str, list[dict]] = {}
    for path in files:
        names = pq.read_schema(path, filesystem=fs).names
        table = pq.read_table(path, filesystem=fs, columns=[c for c in DATA_COLUMNS if c in names])
        if wanted:
            table = table.filter(pc.is_in(table.column("id"), value_set=pa.array(wanted, pa.string())))
        for row in table.to_pylist():
            if row["id"] in found or len(found) < (len(wanted) or rows):
                found.setdefault(row["id"], []).append(row)
        # An example's budgets are written together (one file group), so a file that ends
        # with every example found holds all of their rows.
        if len(found) >= (len(wanted) or rows):
            break
    order = wanted or list(found)
    return [sorted(found[i], key=lambda r: r["budget"]) for i in order if i in found]


def _rejects(fs, root: str) -> list[tuple[str, int, str]]:
    """(reason, rows, the first row's detail) of rejects/, most frequent first."""
    table = storage.read_parquet_dir(fs, root, columns=["reason", "detail"])
    if table is None or not table.num_rows:
        return []
    reasons = table.column("reason").to_pylist()
    detail = dict(zip(reversed(reasons), reversed(table.column("detail").to_pylist())))
    return [(r, n, detail[r] or "") for r, n in Counter(reasons).most_common()]


def marks(cot: str, compressed: str) -> list[tuple[str, bool]]:
    """The original chain cut into (text, kept) pieces, by aligning the compressed chain
    with it: words first (a dropped word is whole), then the characters of words that only
    partly survive (token-level pruning can keep a word's first token and drop the rest).

    Args:
        cot: the original chain.
        compressed: a budget's compressed chain (kept pieces of `cot` joined, stripped).

    Returns:
        (text, kept) pieces that join back to `cot`."""
    found = _by_words(cot, compressed)
    if _visible(t for t, k in found if k) == _visible([compressed]):
        return found
    # Longest-block matching is not a longest common subsequence: where it lost some of
    # the compressed chain (rare: repeated words), match each character at its first
    # occurrence instead, which finds all of a subsequence, if less neatly placed.
    return _by_characters(cot, compressed)


def _visible(texts) -> str:
    return re.sub(r"\s+", "", "".join(texts))


def _runs(cot: str, cuts: list[tuple[int, bool]]) -> list[tuple[str, bool]]:
    """(text, kept) pieces of `cot` from (end, kept) cuts in order, neighbours of one kind
    joined (slices, not repeated concatenation: chains run to 100k characters)."""
    out, start = [], 0
    for i, (stop, kept) in enumerate(cuts):
        if i + 1 < len(cuts) and cuts[i + 1][1] == kept:
            continue
        if stop > start:
            out.append((cot[start:stop], kept))
            start = stop
    return out


def _by_characters(cot: str, compressed: str) -> list[tuple[str, bool]]:
    cuts, j = [], 0
    for i, ch in enumerate(cot):
        hit = j < len(compressed) and ch == compressed[j]
        cuts.append((i + 1, hit))
        j += hit
    return _runs(cot, cuts)


WINDOW = 1000  # words aligned at once: difflib's cost grows with the square of the length


def _word_ops(old: list[str], new: list[str]):
    """difflib's opcodes of the two word lists, found a window at a time: each window
    ends at the last equal block in its first three quarters, where the next one starts
    (the compressed words of W chain words lie within W words of compressed chain). A
    window without one (all its words dropped) is doubled until it has one: its tail of
    compressed words may belong to chain words after it."""
    i0 = j0 = 0
    size = WINDOW
    while i0 < len(old):
        i1, j1 = min(len(old), i0 + size), min(len(new), j0 + size)
        # autojunk off: it would treat frequent words ("the", "=") as noise in long chains
        ops = difflib.SequenceMatcher(None, old[i0:i1], new[j0:j1], autojunk=False).get_opcodes()
        if i1 < len(old):
            cut = [k for k, op in enumerate(ops) if op[0] == "equal" and op[2] <= 3 * size // 4]
            if not cut:
                size *= 2
                continue
            ops = ops[:cut[-1] + 1]
        for tag, a1, a2, b1, b2 in ops:
            yield tag, i0 + a1, i0 + a2, j0 + b1, j0 + b2
        i0, j0, size = i0 + ops[-1][2], j0 + ops[-1][4], WINDOW


def _by_words(cot: str, compressed: str) -> list[tuple[str, bool]]:
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+", cot)]
    old = [cot[a:b] for a, b in words]
    new = compressed.split()
    cuts: list[tuple[int, bool]] = []  # (end, kept) of consecutive stretches of cot
    for tag, i1, i2, j1, j2 in _word_ops(old, new):
        if i1 == i2:  # an insertion cannot come from pruning: nothing of cot to mark
            continue
        start, stop = words[i1][0], words[i2 - 1][1]
        cuts.append((start, True))  # the whitespace before the words: never marked
        if tag == "equal":
            cuts.append((stop, True))
        elif tag == "delete":
            cuts.append((stop, False))
        else:  # partly kept words: align their characters
            span, kept = cot[start:stop], " ".join(new[j1:j2])
            for a, _, size in difflib.SequenceMatcher(None, span, kept, autojunk=False
                                                      ).get_matching_blocks():
                cuts += [(start + a, False), (start + a + size, True)]
            cuts.append((stop, False))
    cuts.append((len(cot), cuts[-1][1] if cuts else True))
    return _runs(cot, cuts)


def _marked(pieces: list[tuple[str, bool]]) -> str:
    """The chain with its dropped pieces between DROP and END, the marks next to the
    dropped characters (whitespace around them stays outside, so lines break there)."""
    out = []
    for t, k in pieces:
        core = t.strip()
        if k or not core:
            out.append(t)
        else:
            lead = t[:len(t) - len(t.lstrip())]
            out.append(lead + DROP + core + END + t[len(lead) + len(core):])
    return "".join(out)


def _wrap(text: str, width: int, lines: int, color: bool, indent: str = "") -> list[str]:
    """Wrap marked text to `width`, at most `lines` lines (the last ends in … when cut),
    then turn the marks into [-…-] or, on a terminal, dim text: a dimmed span that
    crosses a line end is closed there and reopened, so the indent stays plain."""
    rows = textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=" " * len(indent),
                         break_long_words=True, break_on_hyphens=False) or [indent]
    if len(rows) > lines:
        rows = rows[:lines]
        rows[-1] = rows[-1] + " …"
    out, dropping = [], False
    for row in rows:
        head, body = row[:len(indent)], row[len(indent):]
        line = (DROP if dropping else "") + body
        dropping = line.rfind(DROP) > line.rfind(END)
        if dropping:
            line += END
        if color:
            line = line.replace(DROP, DIM).replace(END, UNDIM)
        else:
            line = line.replace(DROP, "[-").replace(END, "-]")
        # half a mark, where a word longer than the line was cut inside it
        out.append(head + line.replace(DROP[0], "").replace(END[0], ""))
    return out


def _share(row: dict) -> str:
    return (f"{row['kept_tokens']}/{row['cot_tokens']} tokens, "
            f"{row['kept_tokens'] / max(row['cot_tokens'], 1):.0%}")


def headline(p: Preview) -> list[str]:
    """The manifest's headline, the kept shares and the reject reasons, as text lines."""
    t = p.totals
    n_budgets = len(t.get("rows_per_budget", {}))
    rows = sum(t.get("rows_per_budget", {}).values())
    out = [f"{p.output}: {t.get('examples', 0)} examples x {n_budgets} budgets "
           f"({rows} data/ rows), {t.get('sft_records', 0)} sft/ records, "
           f"{t.get('rejects', 0)} rejects"]
    m = p.manifest
    if m is None:
        out.append("  no _manifest.json: no run has finished here (or one is writing now)")
    else:
        c = m["config"]
        out.append(f"  model {m['model']['name']}, method {c.get('method', '?')}, unit "
                   f"{c.get('unit', '?')}; last run {m['run_id']} finished {m['finished_at']} "
                   f"in {m['timings']['total_s']:.0f}s, {len(m.get('runs', []))} run(s) in all")
    words = t.get("mean_kept_word_ratio", {})
    if t.get("mean_kept_ratio"):
        out.append("  mean kept share, tokens / words: " + "   ".join(
            f"γ {b}: {r:.0%}" + (f" / {words[b]:.0%}" if b in words else "")
            for b, r in t["mean_kept_ratio"].items()))
    if p.rejects:
        out.append("  rejects by reason:")
        out += [f"    {r:<22} {n:>6}  e.g. {textwrap.shorten(d, 60, placeholder=' …')}"
                for r, n, d in p.rejects[:8]]
        if len(p.rejects) > 8:
            out.append(f"    … and {len(p.rejects) - 8} more reasons")
    return out


def render_text(p: Preview, width: int = 100, lines: int = 3, color: bool = False) -> str:
    """The preview as terminal text.

    Args:
        p: what load() read.
        width: the line width to wrap at.
        lines: at most this many lines for each chain (then …).
        color: dim the dropped words with ANSI codes instead of marking them [-…-].

    Returns:
        The text, ending with a newline."""
    out = [row for line in headline(p) for row in textwrap.wrap(
        line, width, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 2))]
    pad = 12
    for rows in p.examples:
        first = rows[0]
        title = f"── {first['id']} ({first['cot_tokens']} chain tokens) "
        out += ["", title + "─" * max(3, width - len(title))]
        out += _wrap(first["question"], width, 2, color, "question".ljust(pad))
        out += _wrap(first["cot"], width, lines, color, "chain".ljust(pad))
        for r in rows:
            share = r["kept_tokens"] / max(r["cot_tokens"], 1)
            label = f"γ {budget_label(r['budget'])} {share:4.0%}"
            out += _wrap(_marked(marks(r["cot"], r["compressed_cot"])), width, lines, color,
                         label.ljust(pad))
        out += _wrap(first["answer"], width, 1, color, "answer".ljust(pad))
    if p.examples:
        out += [""] + textwrap.wrap("γ: budget, then the share of the chain's tokens kept; "
                                    + (f"{DIM}dimmed{UNDIM}" if color else "[-…-]") + ": dropped",
                                    width)
    if not p.examples:
        out += ["", "no such example in data/"]
    return "\n".join(out) + "\n"


STYLE = page.STYLE + "table{border-collapse:collapse}td,th{padding:0 .8em;text-align:left}"


def render_html(p: Preview) -> str:
    """The preview as one HTML page: the headline and the examples, each budget's chain with
    kept text shaded green and dropped text struck through, as the saliency view shows them.

    Args:
        p: what load() read.

    Returns:
        The page."""
    e = html.escape
    counts, run = headline(p)[:2]  # the shares and the rejects follow as tables
    out = ["<!doctype html><meta charset='utf-8'><title>MIST output preview</title>",
           f"<style>{STYLE}</style>", "<h1>A compression output</h1>",
           f"<p>{e(counts)}<br>{e(run.strip())}</p>"]
    t = p.totals
    if t.get("mean_kept_ratio"):
        words = t.get("mean_kept_word_ratio", {})
        out += ["<table><tr><th>budget γ</th><th>rows</th><th>tokens kept</th><th>words kept</th></tr>"]
        out += [f"<tr><td>{b}</td><td>{t['rows_per_budget'].get(b, '')}</td><td>{r:.1%}</td>"
                f"<td>{words[b]:.1%}</td></tr>" if b in words else
                f"<tr><td>{b}</td><td>{t['rows_per_budget'].get(b, '')}</td><td>{r:.1%}</td><td>–</td></tr>"
                for b, r in t["mean_kept_ratio"].items()]
        out.append("</table>")
    if p.rejects:
        out += ["<h2>Rejects</h2>", "<table><tr><th>reason</th><th>rows</th><th>for example</th></tr>"]
        out += [f"<tr><td>{e(r)}</td><td>{n}</td><td>{e(d)}</td></tr>" for r, n, d in p.rejects]
        out.append("</table>")
    for rows in p.examples:
        first = rows[0]
        out += [f"<h2>{e(first['id'])}</h2>",
                f"<p><b>Question.</b> {e(first['question'])}<br><b>Answer.</b> {e(first['answer'])}</p>",
                f"<h3>chain ({first['cot_tokens']} tokens)</h3>", f"<div class='c'>{e(first['cot'])}</div>"]
        for r in rows:
            spans = "".join(f"<span class='{'k' if k else 'd'}'>{e(t)}</span>"
                            for t, k in marks(r["cot"], r["compressed_cot"]))
            out += [f"<h3>kept at γ = {budget_label(r['budget'])} ({e(_share(r))})</h3>",
                    f"<div class='c'>{spans}</div>"]
    return "\n".join(out) + "\n"


class ShowConfig(Kit):
    """`mist show`'s settings."""

    output: str = setting(..., "the compression job's --output: a folder, s3://… or gs://…",
                          group="output", positional=True)
    rows: int = setting(2, "how many examples to show", group="view", metavar="N")
    id: list[str] = setting([], "show this example instead of the first ones (repeat for "
                            "more)", group="view", metavar="ID", many="repeat", shown="")
    lines: int = setting(3, "at most this many lines of each chain", group="view", metavar="N")
    html: str | None = setting(None, "also write the preview as an HTML page to FILE",
                               group="output", metavar="FILE", shown="")

    _positive = positive("rows", "lines")


def main(argv: list[str] | None = None, prog: str = "mist show") -> int:
    """`mist show`: print the preview of an output folder (and write --html).

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for a folder that is not a compression output."""
    def body() -> int:
        a = parse(ShowConfig, sys.argv[1:] if argv is None else argv, prog,
                  __doc__.split("\n\n")[0])
        preview = load(a.output, a.rows, a.id)
        width = min(shutil.get_terminal_size((100, 24)).columns, 120)
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")  # no-color.org
        print(render_text(preview, width, a.lines, color), end="")
        if a.html:
            with open(a.html, "w", encoding="utf-8") as f:
                f.write(render_html(preview))
            print(f"wrote {a.html}")
        return 0

    return exits.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
