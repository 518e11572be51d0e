"""Adapters for long chain-of-thought corpora, the traces of reasoning models.

In each, the chain is the model's thinking block and the answer its final one: the last
`\\boxed{…}` of what follows the thinking (the solution). A trace without a closed thinking
block is `no_thinking_block`; a solution without `\\boxed{…}` is `no_final_answer` (proofs and
code have no short answer to score the chain against).

- `openr1` (open-r1/OpenR1-Math-220k): `problem`, `generations` (list of `<think>…</think>`
  traces) with `correctness_math_verify` / `correctness_llama` / `is_reasoning_complete`
  (lists of bools, one per generation). One example per generation marked correct (by Math
  Verify or the Llama judge) and complete, with id `<id or uuid>#<generation index>`.
- `openthoughts` (OpenThoughts-114k, Bespoke-Stratos-17k): `conversations`, a user turn then
  an assistant turn `{"from", "value"}` holding `<|begin_of_thought|>…<|end_of_thought|>` and
  `<|begin_of_solution|>…<|end_of_solution|>`.
- `s1k` (simplescaling/s1K): `question`, `thinking_trajectories` (list of strings, joined by
  newlines as s1's training script does), `attempt`; s1K-1.1 rows give
  `deepseek_thinking_trajectory` and `deepseek_attempt` instead.
- `messages` (chat rows): `messages`, a user turn then an assistant turn `{"role",
  "content"}`, the thinking in `<think>…</think>` inside the content or in a
  `reasoning_content` field (as Qwen3's chat template and DeepSeek's API give it)."""
from __future__ import annotations

from typing import Mapping

from ..errors import InvalidExample
from .examples import Example, last_boxed
from .fields import first_field, row_id, text_field

# (opening, closing) tags of the thinking block, then of the solution (None: the solution is
# the rest of the text). The opening thinking tag may be missing: DeepSeek-R1's chat template
# puts `<think>` in the prompt, so some traces start inside the block.
_MARKUP = (("<|begin_of_thought|>", "<|end_of_thought|>", "<|begin_of_solution|>",
            "<|end_of_solution|>"),
           ("<think>", "</think>", None, None))
_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "system": "system"}


def split_thinking(text: str) -> tuple[str, str]:
    """A reasoning model's output -> (thinking, solution), both stripped."""
    for opening, closing, sol_open, sol_close in _MARKUP:
        if closing in text:
            head, _, tail = text.partition(closing)
            thinking = head.split(opening, 1)[-1]
            if sol_open and sol_open in tail:
                tail = tail.split(sol_open, 1)[1]
            if sol_close and sol_close in tail:
                tail = tail.split(sol_close, 1)[0]
            return thinking.strip(), tail.strip()
    raise InvalidExample("no_thinking_block", "no </think> or <|end_of_thought|> closes a "
                         "thinking block")


def _boxed(solution: str, where: str) -> str:
    answer = last_boxed(solution)
    if answer is None or not answer.strip():
        raise InvalidExample("no_final_answer", f"{where} has no \\boxed{{…}} answer")
    return answer.strip()


def _exchange(turns: object, column: str, role: str, text: str) -> tuple[str, dict]:
    """(question, assistant turn) of a one-question conversation: any system turns, then one
    user turn, then one assistant turn. Earlier exchanges would be context the question
    alone does not carry, so longer conversations are refused rather than cut."""
    reason = f"malformed_{column}"
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise InvalidExample(reason, f"{column} must be a list of objects")
    roles = [_ROLES.get(t.get(role)) if isinstance(t.get(role), str) else None for t in turns]
    if roles[-2:] != ["user", "assistant"] or any(r != "system" for r in roles[:-2]):
        raise InvalidExample(reason, f"needs system turns (optional), one user turn, one "
                             f"assistant turn; got {[t.get(role) for t in turns]}")
    return text_field(turns[-2].get(text), "question"), turns[-1]


def openthoughts(row: Mapping) -> Example:
    question, turn = _exchange(first_field(row, "conversations"), "conversations", "from", "value")
    thinking, solution = split_thinking(text_field(turn.get("value"), "cot"))
    return Example(question=question, cot=thinking, answer=_boxed(solution, "the solution"),
                   id=row_id(row))


def messages(row: Mapping) -> Example:
    question, turn = _exchange(first_field(row, "messages"), "messages", "role", "content")
    content = text_field(turn.get("content"), "cot")
    if turn.get("reasoning_content") is not None:
        thinking, solution = text_field(turn["reasoning_content"], "cot").strip(), content
    else:
        thinking, solution = split_thinking(content)
    return Example(question=question, cot=thinking, answer=_boxed(solution, "the reply"),
                   id=row_id(row))


def s1k(row: Mapping) -> Example:
    question = text_field(first_field(row, "question"), "question")
    if row.get("thinking_trajectories") is not None:
        chain, attempt = row["thinking_trajectories"], first_field(row, "attempt")
    else:  # s1K-1.1: the DeepSeek-R1 traces, the ones s1.1 was trained on
        chain = first_field(row, "deepseek_thinking_trajectory", "thinking_trajectories")
        attempt = first_field(row, "deepseek_attempt", "attempt")
    if isinstance(chain, str):
        chain = [chain]
    if not isinstance(chain, list) or not all(isinstance(c, str) for c in chain):
        raise InvalidExample("cot_not_string", "the thinking trajectory must be a string or a "
                             "list of strings", row_id(row))
    return Example(question=question, cot="\n".join(chain).strip(),
                   answer=_boxed(text_field(attempt, "answer"), "the attempt"), id=row_id(row))


def _flags(row: Mapping, column: str, n: int, required: bool = False) -> list:
    """A per-generation list of bools (None entries: not judged). Absent or null: all None."""
    value = first_field(row, column) if required else row.get(column)
    if value is None:
        return [None] * n
    if not isinstance(value, list) or len(value) != n or \
            not all(v is None or isinstance(v, bool) for v in value):
        raise InvalidExample("malformed_generations", f"{column} must be a list of {n} booleans, "
                             f"one per generation")
    return value


def openr1(row: Mapping) -> list[Example]:
    """One example per generation that is marked correct and complete; a row with none is
    rejected as `no_correct_generation`, its detail saying why each generation was left."""
    question = text_field(first_field(row, "problem", "question"), "question")
    base = row_id(row) if row.get("id") is not None else row_id(row, "uuid")
    generations = first_field(row, "generations")
    if not isinstance(generations, list) or not all(isinstance(g, str) for g in generations):
        raise InvalidExample("malformed_generations", "generations must be a list of strings",
                             base)
    n = len(generations)
    verified = _flags(row, "correctness_math_verify", n, required=True)
    judged = _flags(row, "correctness_llama", n)  # the judge, where Math Verify could not parse
    complete = _flags(row, "is_reasoning_complete", n)
    reference = row.get("answer")
    out, left = [], []
    for i, text in enumerate(generations):
        if not (verified[i] or judged[i]):
            left.append(f"{i}: not marked correct")
            continue
        if complete[i] is False:
            left.append(f"{i}: reasoning incomplete")
            continue
        try:
            thinking, solution = split_thinking(text)
            answer = last_boxed(solution)
            if answer is None or not answer.strip():
                # The reference answer is what the generation was verified against.
                answer = text_field(reference, "answer") if reference is not None else ""
            out.append(Example(question=question, cot=thinking, answer=answer.strip(),
                               id=None if base is None else f"{base}#{i}"))
        except InvalidExample as e:
            left.append(f"{i}: {e.reason}")
    if not out:
        why = f"{n} generations, none usable: " + "; ".join(left) if n else "no generations"
        raise InvalidExample("no_correct_generation", why, base)
    return out
