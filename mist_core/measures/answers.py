"""Reading answers and intermediate results out of text, for the evaluation harness.

Two corpus styles: `gsm8k` (plain-text arithmetic, numeric answers) and `math` (LaTeX,
answers compared after the MATH dataset's usual normalisation). Pure text functions, no
model."""
from __future__ import annotations

import re

from ..data.examples import last_boxed

STYLES = ("gsm8k", "math")

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def style_for(adapter: str, cot: str = "") -> str:
    """The answer style of a corpus: its adapter's; for generic corpora, `math` where the
    chain holds LaTeX math, else `gsm8k`."""
    if adapter in STYLES:
        return adapter
    return "math" if math_spans(cot) else "gsm8k"


# ---------------------------------------------------------------- answers

def first_number(text: str) -> float | None:
    """The first number in a text, thousands separators and a leading $ allowed."""
    m = _NUMBER.search(_THOUSANDS.sub("", text))
    return float(m.group()) if m else None


def gsm8k_prediction(text: str) -> float | None:
    """The number a model stated after `The answer is `: the first number, or, where it
    wrote an equation ("9 * 2 = 18 dollars"), the first number after its last `=`."""
    if "=" in text:
        after = first_number(text.rsplit("=", 1)[1])
        if after is not None:
            return after
    return first_number(text)


def _numeric(s: str) -> float | None:
    """The value of a string that is only a number (after removing separators), else None."""
    s = _THOUSANDS.sub("", s.strip())
    return float(s) if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", s) else None


def _fix_fracs(s: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2} (as in the MATH reference code)."""
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if p.startswith("{") or len(p) < 2:
            out += p
            continue
        a, b, rest = p[0], p[1], p[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def _unwrap(s: str, command: str) -> str:
    r"""\text{abc} -> abc for every occurrence (braces matched)."""
    key = "\\" + command + "{"
    while key in s:
        i = s.index(key)
        j, depth = i + len(key), 1
        while j < len(s) and depth:
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            j += 1
        s = s[:i] + s[i + len(key): j - 1] + s[j:]
    return s


def normalize_math(s: str) -> str:
    """The MATH reference normalisation (Hendrycks et al.'s `strip_string`), plus
    \\text/\\mbox unwrapping: spacing, \\left/\\right, degrees, dollars, percent, units
    in \\text, `x =` prefixes, dfrac/tfrac, unbraced fractions and roots, a/b."""
    s = s.strip().replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]+\}\s*$", "", s) if re.search(r"\d", s) else s  # units
    for cmd in ("text", "textbf", "mbox", "mathrm"):
        s = _unwrap(s, cmd)
    s = s.replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:  # "x = 5" -> "5"
        s = s.split("=")[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    s = s.rstrip(".")
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m[1]}}}{{{m[2]}}}"
    return s


def math_prediction(text: str) -> str:
    """The answer a model wrote after `The answer is `: the last \\boxed{} if any, else the
    first math span ($…$, \\(…\\)) if the text opens with one, else the text up to a
    sentence end."""
    text = text.strip().lstrip(":").strip()  # "The answer is: 14"
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for open_, close in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(open_):
            end = text.find(close, len(open_))
            return text[len(open_): end if end >= 0 else None]
    return re.split(r"\.\s|\.$", text, maxsplit=1)[0]


def answer_correct(prediction: str, gold: str, style: str) -> bool:
    """Whether a generated answer matches the gold one. gsm8k: the stated number
    (gsm8k_prediction) against the gold one, as numbers. math: the stated answer
    (math_prediction, or the right of its last `=`) and the gold one, both normalised
    (normalize_math), equal as strings or, where both are plain numbers, as numbers."""
    if style == "gsm8k":
        p, g = gsm8k_prediction(prediction), first_number(gold)
        return p is not None and g is not None and abs(p - g) <= 1e-6 * max(1.0, abs(g))
    if style != "math":
        raise ValueError(f"answer style must be one of {STYLES}, not {style!r}")
    g = normalize_math(gold)
    gn = _numeric(g)
    pred = math_prediction(prediction)
    # an equation ("3^3 = 27") states its answer on the right of its last `=`
    for cand in [pred] + ([pred.rsplit("=", 1)[1]] if "=" in pred else []):
        p = normalize_math(cand)
        pn = _numeric(p)
        if p == g or (pn is not None and gn is not None
                      and abs(pn - gn) <= 1e-6 * max(1.0, abs(gn))):
            return True
    return False


# ---------------------------------------------------------------- intermediate results

# Inline $…$ follows pandoc's rule, which keeps currency out: the opening $ has a non-space
# on its right, the closing one a non-space on its left and no digit after it ("costs $3
# and $4" is not math).
_MATH_SPAN = re.compile(
    r"\$\$(?P<a>.+?)\$\$|(?<![\\$])\$(?![\s$])(?P<b>[^$]+?)(?<![\s\\])\$(?!\d)|\\\[(?P<c>.+?)\\\]|\\\((?P<d>.+?)\\\)"
    r"|\\begin\{(?P<env>align|equation|eqnarray|gather|multline)\*?\}(?P<e>.+?)\\end\{(?P=env)\*?\}",
    re.S)


def math_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the contents of LaTeX math: $…$, $$…$$, \\[…\\], \\(…\\) and
    align-like environments."""
    out = []
    for m in _MATH_SPAN.finditer(text):
        for g in "abcde":
            if m.group(g) is not None:
                out.append(m.span(g))
    return out


_GSM8K_RESULT = re.compile(r"=\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")
# What ends a right-hand side inside math: another relation, a separator, a line break.
_RHS_STOP = re.compile(r"=|,|;|&|\\\\|<|>|\\le(?:q)?\b|\\ge(?:q)?\b|\\approx|\\ne(?:q)?\b|"
                       r"\\quad|\\qquad|\\text|\\implies|\\Rightarrow")


def _depth(text: str, start: int, stop: int) -> int:
    return sum({"{": 1, "}": -1}.get(ch, 0) for ch in text[start:stop])


def _rhs_spans(text: str, start: int, stop: int) -> list[tuple[int, int]]:
    """Right-hand sides of the `=` signs in text[start:stop], each up to the next relation
    or separator at bracket depth 0, trimmed of spaces and a final period."""
    out = []
    i = start
    while True:
        eq = text.find("=", i, stop)
        if eq < 0:
            return out
        if _depth(text, start, eq) > 0:  # inside braces: a subscript such as \sum_{i=1}
            i = eq + 1
            continue
        j, depth = eq + 1, 0
        while j < stop:
            ch = text[j]
            if ch in "({[":
                depth += 1
            elif ch in ")}]":
                if depth == 0:
                    break
                depth -= 1
            elif depth == 0 and _RHS_STOP.match(text, j):
                break
            j += 1
        a, b = eq + 1, j
        while a < b and text[a].isspace():
            a += 1
        while b > a and (text[b - 1].isspace() or text[b - 1] == "."):
            b -= 1
        if b > a:
            out.append((a, b))
        i = eq + 1


def intermediate_results(cot: str, style: str) -> list[tuple[int, int]]:
    """Character spans of a chain's intermediate results. gsm8k: the number right after
    each `=`. math: what stands on the right of each `=` inside math (numbers and
    expressions)."""
    if style == "gsm8k":
        out = []
        for m in _GSM8K_RESULT.finditer(cot):
            a, b = m.span(1)
            while b > a and cot[b - 1] == ",":  # "= 12, so" -> "12"
                b -= 1
            out.append((a, b))
        return out
    if style == "math":
        return [s for a, b in math_spans(cot) for s in _rhs_spans(cot, a, b)]
    raise ValueError(f"answer style must be one of {STYLES}, not {style!r}")


def answer_mention(cot: str, answer: str, style: str) -> tuple[int, int] | None:
    """Character span of the chain's last statement of the gold answer, if it states it:
    gsm8k, the last number equal to it ("70,000" states 70000); math, the last occurrence
    of its text (the adapter took it from the chain's last \\boxed{})."""
    if style == "gsm8k":
        gold = first_number(answer)
        found = None
        for m in re.finditer(r"-?\d[\d,]*(?:\.\d+)?", cot):
            a, b = m.span()
            while b > a and cot[b - 1] == ",":
                b -= 1
            value = _numeric(cot[a:b])
            if gold is not None and value is not None and abs(value - gold) <= 1e-9 * max(1.0, abs(gold)):
                found = (a, b)
        return found
    at = cot.rfind(answer.strip())
    return (at, at + len(answer.strip())) if at >= 0 and answer.strip() else None

