"""The paper's token-type taxonomy: what kind of text each chain token carries.

A chain is cut into lexical items (numbers, LaTeX commands, words, operator symbols,
other characters); a token takes the type of the first item its non-space characters
touch, so the sub-word pieces of one word share that word's type."""
from __future__ import annotations

import re

import numpy as np

from .answers import math_spans

TYPES = ("number", "operator", "variable", "connective", "quantifier", "content", "function",
         "other")
TYPE_LABELS = {"number": "numbers", "operator": "math operators",
               "variable": "variables/functions", "connective": "connectives",
               "quantifier": "quantifiers/negation", "content": "content words",
               "function": "function words", "other": "other (punctuation, markup)"}

_ITEM = re.compile(r"(?P<number>\d+(?:,\d{3}(?!\d))*(?:\.\d+)?)|(?P<command>\\[A-Za-z]+)"
                   r"|(?P<word>[A-Za-z]+(?:['’][A-Za-z]+)?)|(?P<op>[-+*/=<>^×÷·−±≤≥≠%!|])"
                   r"|(?P<other>\S)")
_OP_COMMANDS = {"times", "cdot", "div", "pm", "mp", "le", "leq", "ge", "geq", "ne", "neq",
                "approx", "equiv", "lt", "gt", "cdots", "ldots", "sim", "propto", "mid",
                "implies", "Rightarrow", "to", "cap", "cup", "in", "subset", "subseteq"}
_MARKUP = {"text", "textbf", "mbox", "mathrm", "left", "right", "begin", "end", "quad",
           "qquad", "boxed", "displaystyle", "hline", "noindent", "emph", "mathbf"}
CONNECTIVES = {"so", "therefore", "thus", "hence", "then", "because", "since", "but",
               "and", "or", "if", "however", "also", "which", "means", "first", "next",
               "finally", "consequently", "otherwise", "although", "while", "when", "whereas",
               "instead", "furthermore", "moreover", "similarly", "thereby", "now"}
QUANTIFIERS = {"all", "each", "every", "some", "any", "no", "not", "none", "never", "both",
               "either", "neither", "many", "much", "more", "less", "fewer", "few", "most",
               "least", "only", "nothing", "nobody", "several", "per", "n't", "cannot",
               "without"}
FUNCTION_WORDS = {
    "a", "an", "the", "of", "to", "in", "on", "at", "for", "with", "by", "from", "into",
    "onto", "over", "under", "up", "down", "out", "off", "about", "as", "than", "is", "are",
    "was", "were", "be", "been", "being", "am", "it", "its", "he", "she", "they", "them",
    "his", "her", "their", "theirs", "him", "we", "us", "our", "you", "your", "i", "me", "my",
    "this", "that", "these", "those", "there", "here", "has", "have", "had", "do", "does",
    "did", "will", "would", "can", "could", "shall", "should", "may", "might", "must", "what",
    "who", "whom", "whose", "where", "how", "why", "let", "let's", "it's", "there's",
    "that's", "he's", "she's", "we're", "they're", "after", "before", "between", "through",
    "during", "until", "upon", "within", "via", "each's", "s", "t", "one's"}


def _word_type(word: str, in_math: bool) -> str:
    lower = word.lower().replace("’", "'")
    if len(word) == 1 and (in_math or word not in ("a", "A", "I")):
        return "variable"
    if in_math:
        return "variable"  # a multi-letter identifier inside math (ab, xy)
    if lower in CONNECTIVES:
        return "connective"
    if lower in QUANTIFIERS or lower.endswith("n't"):
        return "quantifier"
    if lower in FUNCTION_WORDS:
        return "function"
    return "content"


def char_types(text: str) -> list[tuple[int, int, str]]:
    """(start, stop, type) of every lexical item of a text."""
    math = math_spans(text)
    inside = np.zeros(len(text) + 1, dtype=bool)
    for a, b in math:
        inside[a:b] = True
    out = []
    for m in _ITEM.finditer(text):
        kind, (a, b) = m.lastgroup, m.span()
        item = m.group()
        if kind == "number":
            t = "number"
        elif kind == "command":
            name = item[1:]
            t = "operator" if name in _OP_COMMANDS else "other" if name in _MARKUP else "variable"
        elif kind == "word":
            t = _word_type(item, bool(inside[a]))
        elif kind == "op":
            between_letters = (item == "-" and 0 < a and b < len(text)
                               and text[a - 1].isalpha() and text[b].isalpha())
            t = "other" if between_letters or (item in "!|" and not inside[a]) else "operator"
        else:
            t = "other"
        out.append((a, b, t))
    return out


def token_types(text: str, offsets: np.ndarray) -> list[str]:
    """The type of each token, given the tokens' character spans in `text`."""
    items = char_types(text)
    starts = np.array([a for a, _, _ in items] + [len(text) + 1])
    stops = np.array([b for _, b, _ in items] + [len(text) + 1])
    out = []
    for a, b in np.asarray(offsets).reshape(-1, 2):
        # the first item that ends after the token starts and begins before it ends
        i = int(np.searchsorted(stops, a, side="right"))
        out.append(items[i][2] if i < len(items) and starts[i] < b else "other")
    return out
