"""Prompt templates: an example becomes the full input [x; c; a] and the no-chain input
[x; a], with the spans MIST needs recorded exactly.

Each input is tokenised as one string (so tokens are the model's natural ones) and the
spans are read off the tokenizer's character offsets: a chain token is any token that
overlaps the chain's characters, an answer token any token that overlaps the answer's."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidExample
from .examples import Example

ANSWER_LEAD = "The answer is "
_COT, _ANS = "@@MIST_COT@@", "@@MIST_ANSWER@@"


@dataclass
class Encoded:
    """One example, tokenised. Chain tokens are source_ids[chain_start:chain_start+T];
    the objective is the log-likelihood of source_ids[answer_start:answer_stop] (and of
    target_ids[target_final+1:], the same answer, in the no-chain input)."""

    example: Example
    source_ids: np.ndarray
    chain_start: int
    chain_len: int
    answer_start: int
    target_ids: np.ndarray
    target_final: int
    chain_offsets: np.ndarray  # [T, 2] character spans of the chain tokens within example.cot

    @property
    def answer_stop(self) -> int:
        return len(self.source_ids)

    @property
    def chain_stop(self) -> int:
        return self.chain_start + self.chain_len

    @property
    def answer_len(self) -> int:
        return self.answer_stop - self.answer_start

    @property
    def prefix_len(self) -> int:
        """Leading tokens the two inputs share (the question part)."""
        n = min(len(self.source_ids), len(self.target_ids))
        diff = np.nonzero(self.source_ids[:n] != self.target_ids[:n])[0]
        return int(diff[0]) if len(diff) else n


def _overlapping(offsets: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.nonzero((offsets[:, 0] < stop) & (offsets[:, 1] > start))[0]


class Template:
    """Renders (question, chain, answer) as text; subclasses say how."""

    name = "base"
    add_special_tokens = False

    def __init__(self, tokenizer, max_length: int | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("templates need a fast tokenizer (character offsets)")
        self.tokenizer = tokenizer
        self.max_length = max_length

    def prefix(self, question: str) -> str:
        """The text before the assistant's content (chain, answer line) for this question."""
        raise NotImplementedError

    def frame(self, question: str) -> tuple[str, str, str]:
        """The text before the chain, the text between the chain and the answer line, and
        the no-chain input's text before its answer line."""
        before = self.prefix(question)
        return before, "\n\n", before

    def _tokenize(self, text: str):
        enc = self.tokenizer(text, add_special_tokens=self.add_special_tokens,
                             return_offsets_mapping=True)
        return np.asarray(enc["input_ids"], dtype=np.int64), np.asarray(enc["offset_mapping"],
                                                                         dtype=np.int64)

    def encode(self, ex: Example) -> Encoded:
        """Tokenise an example as the full input [x; c; a] and the no-chain input [x; a].

        Args:
            ex: the example.

        Returns:
            The Encoded example: both inputs' token ids and the spans of the chain and the
            answer in them.

        Raises:
            InvalidExample: the answer or the chain tokenizes to nothing (`answer_no_tokens`,
                `cot_no_tokens`), the two share a token (`span_overlap`), or the input is
                longer than max_length (`too_long`).
            ValueError: (chat) the tokenizer's chat template does not render the assistant's
                turn verbatim.
        """
        before, between, nochain = self.frame(ex.question)
        chain_at = len(before)
        full = before + ex.cot + between + ANSWER_LEAD
        answer_at = len(full)
        full += ex.answer
        ids, offsets = self._tokenize(full)
        chain = _overlapping(offsets, chain_at, chain_at + len(ex.cot))
        answer = _overlapping(offsets, answer_at, len(full))
        if len(answer) == 0:
            raise InvalidExample("answer_no_tokens", "the answer tokenizes to nothing", ex.id)
        if len(chain) == 0:
            raise InvalidExample("cot_no_tokens", "the chain tokenizes to nothing", ex.id)
        if chain[-1] >= answer[0]:
            raise InvalidExample("span_overlap", "chain and answer share a token", ex.id)
        if self.max_length is not None and len(ids) > self.max_length:
            raise InvalidExample("too_long", f"{len(ids)} tokens > model context "
                                 f"{self.max_length}", ex.id)
        ids = ids[: answer[-1] + 1]

        nochain += ANSWER_LEAD
        t_answer_at = len(nochain)
        nochain += ex.answer
        t_ids, t_offsets = self._tokenize(nochain)
        t_answer = _overlapping(t_offsets, t_answer_at, len(nochain))
        if len(t_answer) == 0 or t_answer[0] == 0:
            raise InvalidExample("answer_no_tokens", "no-chain input has no scorable answer", ex.id)
        t_ids = t_ids[: t_answer[-1] + 1]

        chain_offsets = np.clip(offsets[chain] - chain_at, 0, len(ex.cot))
        return Encoded(example=ex, source_ids=ids, chain_start=int(chain[0]),
                       chain_len=len(chain), answer_start=int(answer[0]), target_ids=t_ids,
                       target_final=int(t_answer[0]) - 1, chain_offsets=chain_offsets)


class ChatTemplate(Template):
    """The tokenizer's own chat template: the question is the user turn; the chain, then
    the answer line, is the assistant turn."""

    name = "chat"

    def prefix(self, question: str) -> str:
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": _COT + _ANS}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        if text.count(_COT) != 1 or text.count(_ANS) != 1:
            raise ValueError("the tokenizer's chat template does not render the assistant "
                             "turn verbatim; use the plain template")
        return text.split(_COT)[0]


class ThinkTemplate(Template):
    """Reasoning models whose chat template has a thinking block (Qwen3, DeepSeek-R1
    distills): the chain is the inside of the assistant's thinking block and the answer line
    follows the block, as the model writes them. The no-chain input keeps an empty block
    (what Qwen3 renders with thinking off), so the answer line stays where it always is."""

    name = "think"

    def frame(self, question: str) -> tuple[str, str, str]:
        user = [{"role": "user", "content": question}]
        turn = {"role": "assistant", "content": f"<think>\n{_COT}\n</think>\n\n{_ANS}"}
        text = self.tokenizer.apply_chat_template(user + [turn], tokenize=False)
        if text.count(_COT) == 1 and text.count(_ANS) == 1:
            before, rest = text.split(_COT)
            between = rest.split(_ANS)[0]
            if "<think>" in before and "</think>" in between:  # the model's own rendering
                return before, between, before + between
        # Templates that drop the thinking from a rendered turn (DeepSeek-R1 distills keep
        # only what follows </think>): the generation prompt, with the block opened where the
        # prompt does not open it already.
        before = self.tokenizer.apply_chat_template(user, tokenize=False,
                                                    add_generation_prompt=True)
        if not before.rstrip("\n").endswith("<think>"):
            before += "<think>\n"
        elif not before.endswith("\n"):
            before += "\n"
        between = "\n</think>\n\n"
        return before, between, before + between

    def prefix(self, question: str) -> str:
        return self.frame(question)[0]


class PlainTemplate(Template):
    """A plain-text prompt, for base models."""

    name = "plain"
    add_special_tokens = True

    def prefix(self, question: str) -> str:
        return f"Question: {question}\nSolution:\n"


TEMPLATES = ("auto", "chat", "plain", "think")


def has_thinking(tokenizer) -> bool:
    """Whether the tokenizer's chat template handles a `<think>…</think>` block."""
    return "</think>" in str(getattr(tokenizer, "chat_template", None) or "")


def get_template(name: str, tokenizer, max_length: int | None = None) -> Template:
    """The prompt template that renders examples as the model reads them and records the
    chain's and the answer's token spans (Template.encode).

    Args:
        name: "chat" (the tokenizer's chat template: the question is the user turn, the
            chain and the answer line the assistant's), "think" (the chain inside the
            assistant's thinking block), "plain" (`Question: …` then `Solution:`, for base
            models) or "auto": think where the tokenizer's chat template has a thinking
            block, else chat where it has a chat template, else plain.
        tokenizer: a fast tokenizer (the templates read its character offsets).
        max_length: the model's context: a longer input fails as `too_long`; None: no limit.

    Returns:
        The Template; its `encode(example)` gives the Encoded example.

    Raises:
        ValueError: an unknown name, or a tokenizer that is not a fast one.

    Examples:
        >>> from mist_core import Example, get_template
        >>> from mist_core.distill.synthetic import build_tokenizer, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())  # a word-level one, no download
        >>> template = get_template("auto", tokenizer, max_length=512)
        >>> template.name
        'chat'
        >>> enc = template.encode(Example("Ann has 3 apples. She buys 4 more apples. "
        ...                               "How many apples does Ann have?",
        ...                               "She buys 4 more, so 3 + 4 = 7.", "7"))
        >>> enc.chain_len, enc.answer_len
        (12, 1)
        >>> tokenizer.decode(enc.source_ids[enc.chain_start:enc.chain_stop])
        'She buys 4 more, so 3 + 4 = 7.'
    """
    if name == "auto":
        name = ("think" if has_thinking(tokenizer) else "chat"
                if getattr(tokenizer, "chat_template", None) else "plain")
    if name == "chat":
        return ChatTemplate(tokenizer, max_length)
    if name == "think":
        return ThinkTemplate(tokenizer, max_length)
    if name == "plain":
        return PlainTemplate(tokenizer, max_length)
    raise ValueError(f"unknown template {name!r}: use {', '.join(TEMPLATES)}")
