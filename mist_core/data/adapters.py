"""Every corpus adapter by name: a row -> its Example (mist_core.data.examples for GSM8K, MATH and
generic columns; mist_core.data.longcot for the long-CoT corpora)."""
from __future__ import annotations

from typing import Callable, Mapping

from . import examples, longcot
from .examples import Example

ADAPTERS = ("gsm8k", "math", "generic", "openr1", "openthoughts", "s1k", "messages")


def get_adapter(name: str, **columns: str) -> Callable[[Mapping], Example | list[Example]]:
    r"""The adapter of a corpus: a function from one row (a mapping of column names to
    values) to its Example; `openr1` gives a list instead (one Example per usable
    generation).

    Args:
        name: one of ADAPTERS: "gsm8k", "math", "generic", "openr1", "openthoughts", "s1k"
            or "messages".
        **columns: for "generic" only, the column of each text: `question`, `cot`, `answer`
            and `id` (defaults: the same names).

    Returns:
        A callable row -> Example (or list of Examples) that raises InvalidExample, with its
        reason, for a row it cannot use.

    Raises:
        ValueError: an unknown adapter name.

    Examples:
        >>> from mist_core import get_adapter
        >>> gsm8k = get_adapter("gsm8k")
        >>> ex = gsm8k({"question": "Ann has 3 apples and buys 4 more. How many?",
        ...             "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"})
        >>> ex.cot, ex.answer
        ('She has 3 + 4 = 7 apples.', '7')
        >>> get_adapter("generic", cot="steps")({"question": "What is 2 + 2?",
        ...                                      "steps": "2 + 2 = 4.", "answer": "4", "id": 5})
        Example(question='What is 2 + 2?', cot='2 + 2 = 4.', answer='4', id='5')
    """
    if name == "gsm8k":
        return examples.gsm8k
    if name == "math":
        return examples.math
    if name == "generic":
        return examples.generic(**columns)
    if name in ADAPTERS:
        return getattr(longcot, name)
    raise ValueError(f"unknown adapter {name!r}: use {', '.join(ADAPTERS)}")
