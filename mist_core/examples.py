"""Reasoning examples and the adapters that turn corpus rows into them."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Callable, Mapping

from .errors import InvalidExample


@dataclass(frozen=True)
class Example:
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


def _field(row: Mapping, *names: str) -> object:
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise InvalidExample("missing_column", f"needs one of {list(names)}, row has {sorted(row)}")


def _row_id(row: Mapping, column: str = "id") -> str | None:
    value = row.get(column)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidExample("id_not_string", f"got {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        # A blank id names nothing: every such row would share it and all but the first
        # would be dropped as duplicates.
        raise InvalidExample("empty_id", "")
    return str(value)


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidExample(f"{field}_not_string", f"got {type(value).__name__}")
    return value


_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k(row: Mapping) -> Example:
    """GSM8K: chain = text before `####` without `<<…>>` calculator notes; answer after it."""
    solution = _text(_field(row, "answer", "solution"), "answer")
    if "####" not in solution:
        raise InvalidExample("no_final_answer", "GSM8K solution has no '####' line", _row_id(row))
    cot, answer = solution.rsplit("####", 1)
    return Example(question=_text(_field(row, "question"), "question"),
                   cot=_CALC.sub("", cot).strip(), answer=answer.strip(), id=_row_id(row))


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
    solution = _text(_field(row, "solution", "answer"), "solution")
    answer = last_boxed(solution)
    if answer is None:
        raise InvalidExample("no_final_answer", "MATH solution has no \\boxed{…}", _row_id(row))
    return Example(question=_text(_field(row, "problem", "question"), "question"),
                   cot=_MATH_TAIL.sub("", solution).strip(), answer=answer.strip(), id=_row_id(row))


def generic(question: str = "question", cot: str = "cot", answer: str = "answer",
            id: str = "id") -> Callable[[Mapping], Example]:
    """An adapter for corpora that already hold the three texts in columns."""
    def adapt(row: Mapping) -> Example:
        return Example(question=_text(_field(row, question), "question"),
                       cot=_text(_field(row, cot), "cot"),
                       answer=_text(_field(row, answer), "answer"), id=_row_id(row, id))
    return adapt


# The long-CoT corpora's adapters live in mist_core.longcot.
ADAPTERS = ("gsm8k", "math", "generic", "openr1", "openthoughts", "s1k", "messages")


def get_adapter(name: str, **columns: str) -> Callable[[Mapping], Example | list[Example]]:
    """A row -> its Example; `openr1` gives a list (one Example per usable generation)."""
    if name == "gsm8k":
        return gsm8k
    if name == "math":
        return math
    if name == "generic":
        return generic(**columns)
    if name in ADAPTERS:
        from . import longcot

        return getattr(longcot, name)
    raise ValueError(f"unknown adapter {name!r}: use {', '.join(ADAPTERS)}")
