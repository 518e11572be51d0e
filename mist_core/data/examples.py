"""Reasoning examples, and the adapters of the short-chain corpora (GSM8K, MATH, any corpus
with the three texts in columns) that turn rows into them; mist_core.data.adapters names them
all."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Callable, Mapping

from ..errors import InvalidExample
from .fields import first_field, row_id, text_field


@dataclass(frozen=True)
class Example:
    """One reasoning example: a question, the chain of thought that solves it and the final
    answer. The three texts are checked when it is made, so an Example that exists can be
    tokenised (templates) and scored; what a model's template cannot take fails later, at
    encoding.

    Args:
        question: the question x, as the user turn or prompt.
        cot: the chain of thought c, the text that pruning compresses.
        answer: the final answer a, whose log-likelihood the scorers explain.
        id: the example's own id, or None for a hash of its three texts (`key`).

    Raises:
        InvalidExample: a text that is not a string, is blank or holds a null byte
            (reasons `<field>_not_string`, `empty_<field>`, `null_byte_in_<field>`), or an
            id that is not a string (`id_not_string`).

    Examples:
        >>> from mist_core import Example
        >>> ex = Example("Ann has 3 apples. She buys 4 more apples. How many apples does Ann have?",
        ...              "She buys 4 more, so 3 + 4 = 7.", "7", id="ann")
        >>> ex.key
        'ann'
        >>> len(Example("What is 2 + 2?", "2 + 2 = 4.", "4").key)  # a hash of the texts
        32
        >>> Example("What is 2 + 2?", "   ", "4")
        Traceback (most recent call last):
        ...
        mist_core.errors.InvalidExample: empty_cot
    """

    question: str
    cot: str
    answer: str
    id: str | None = None

    def __post_init__(self):
        validate(self)

    @property
    def key(self) -> str:
        """The example's stable id: its own, or a hash of its three texts."""
        return self.id if self.id is not None else stable_id(self.question, self.cot, self.answer)


def stable_id(question: str, cot: str, answer: str) -> str:
    blob = json.dumps([question, cot, answer], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


def validate(ex: Example) -> None:
    for field in ("question", "cot", "answer"):
        value = getattr(ex, field)
        if not isinstance(value, str):
            raise InvalidExample(f"{field}_not_string", f"got {type(value).__name__}", ex.id)
        if not value.strip():
            raise InvalidExample(f"empty_{field}", "", ex.id)
        if "\x00" in value:
            raise InvalidExample(f"null_byte_in_{field}", "", ex.id)
    if ex.id is not None and not isinstance(ex.id, str):
        raise InvalidExample("id_not_string", f"got {type(ex.id).__name__}", None)


_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k(row: Mapping) -> Example:
    """GSM8K: chain = text before `####` without `<<…>>` calculator notes; answer after it."""
    solution = text_field(first_field(row, "answer", "solution"), "answer")
    if "####" not in solution:
        raise InvalidExample("no_final_answer", "GSM8K solution has no '####' line", row_id(row))
    cot, answer = solution.rsplit("####", 1)
    return Example(question=text_field(first_field(row, "question"), "question"),
                   cot=_CALC.sub("", cot).strip(), answer=answer.strip(), id=row_id(row))


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{…}` (or `\\fbox{…}`), braces matched."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_MATH_TAIL = re.compile(r"\s*The answer is:.*\Z", re.S)


def math(row: Mapping) -> Example:
    """MATH: answer = last `\\boxed{…}`; chain = the solution (a trailing
    `The answer is: …` line, as in MATH-500, is dropped: the template adds its own)."""
    solution = text_field(first_field(row, "solution", "answer"), "solution")
    answer = last_boxed(solution)
    if answer is None:
        raise InvalidExample("no_final_answer", "MATH solution has no \\boxed{…}", row_id(row))
    return Example(question=text_field(first_field(row, "problem", "question"), "question"),
                   cot=_MATH_TAIL.sub("", solution).strip(), answer=answer.strip(), id=row_id(row))


def generic(question: str = "question", cot: str = "cot", answer: str = "answer",
            id: str = "id") -> Callable[[Mapping], Example]:
    """An adapter for corpora that already hold the three texts in columns."""
    def adapt(row: Mapping) -> Example:
        return Example(question=text_field(first_field(row, question), "question"),
                       cot=text_field(first_field(row, cot), "cot"),
                       answer=text_field(first_field(row, answer), "answer"), id=row_id(row, id))
    return adapt
