"""Every corpus adapter by name: a row -> its Example (mist_core.data.examples for GSM8K, MATH and
generic columns; mist_core.data.longcot for the long-CoT corpora)."""
from __future__ import annotations

from typing import Callable, Mapping

from . import examples, longcot
from .examples import Example

ADAPTERS = ("gsm8k", "math", "generic", "openr1", "openthoughts", "s1k", "messages")


def get_adapter(name: str, **columns: str) -> Callable[[Mapping], Example | list[Example]]:
    """A row -> its Example; `openr1` gives a list (one Example per usable generation)."""
    if name == "gsm8k":
        return examples.gsm8k
    if name == "math":
        return examples.math
    if name == "generic":
        return examples.generic(**columns)
    if name in ADAPTERS:
        return getattr(longcot, name)
    raise ValueError(f"unknown adapter {name!r}: use {', '.join(ADAPTERS)}")
