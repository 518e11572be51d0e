"""What a compression keeps of a chain, measured per token (intermediate results, numbers,
token types, the chain's statement of the answer), and kept masks as stored in the
evaluation's results. No model: the report re-measures stored results with it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .answers import answer_mention, intermediate_results
from .taxonomy import TYPES, token_types

@dataclass
class ChainProfile:
    """Per-token facts of one chain that do not depend on the compression."""

    types: np.ndarray  # str [T], see taxonomy.TYPES
    numbers: np.ndarray  # bool [T]: tokens holding a digit
    results: list[np.ndarray]  # token indices of each intermediate result
    answer: np.ndarray | None = None  # token indices of the chain's last statement of the answer

    @classmethod
    def of(cls, cot: str, offsets: np.ndarray, style: str, answer: str | None = None) -> "ChainProfile":
        offsets = np.asarray(offsets).reshape(-1, 2)
        texts = [cot[a:b] for a, b in offsets]

        def tokens(a, b):
            return np.nonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))[0]

        results = [idx for idx in (tokens(a, b) for a, b in intermediate_results(cot, style)) if len(idx)]
        span = answer_mention(cot, answer, style) if answer is not None else None
        return cls(types=np.array(token_types(cot, offsets)),
                   numbers=np.array([any(ch.isdigit() for ch in t) for t in texts], dtype=bool),
                   results=results, answer=tokens(*span) if span else None)

    def totals(self) -> dict:
        return {"tokens": len(self.types), "numbers": int(self.numbers.sum()),
                "results": len(self.results), "answer": int(self.answer is not None),
                "types": [int((self.types == t).sum()) for t in TYPES]}

    def kept(self, kept: np.ndarray) -> dict:
        """Counts of what `kept` keeps; an intermediate result (or the answer's statement)
        survives only if every one of its tokens is kept."""
        kept = np.asarray(kept, dtype=bool)
        return {"tokens": int(kept.sum()), "numbers": int((kept & self.numbers).sum()),
                "results": int(sum(kept[idx].all() for idx in self.results)),
                "answer": int(self.answer is not None and bool(kept[self.answer].all())),
                "types": [int((kept & (self.types == t)).sum()) for t in TYPES]}


def pack_mask(kept: np.ndarray | None) -> str:
    """A kept mask as hex (8 tokens a byte), so stored results can be re-measured."""
    return "" if kept is None else np.packbits(np.asarray(kept, dtype=bool)).tobytes().hex()


def unpack_mask(text: str, T: int) -> np.ndarray:
    if not text:
        return np.zeros(T, dtype=bool)
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:T].astype(bool)
