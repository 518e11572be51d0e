"""What the compression job writes: the schemas of its output rows, how extra input columns
are carried through, and the SFT records built from compressed chains.

Plain functions and pyarrow schemas, with no Ray, so that anything reading or producing
these files (the job, a trainer's loader, a test) can share them."""
from __future__ import annotations

import hashlib
import json
import re
from typing import Iterable, Sequence

import pyarrow as pa

from .templates import ANSWER_LEAD

# One row per (example, budget).
DATA_SCHEMA = pa.schema([
    ("id", pa.string()), ("question", pa.string()), ("cot", pa.string()),
    ("answer", pa.string()), ("budget", pa.float64()), ("compressed_cot", pa.string()),
    ("kept_tokens", pa.int64()), ("cot_tokens", pa.int64()),
    # Whitespace-separated words of compressed_cot and cot: the budget counts tokens, so the
    # share of words kept is measured too (pruning by words keeps whole words, by tokens not).
    ("kept_words", pa.int64()), ("cot_words", pa.int64()),
    ("method", pa.string()), ("model", pa.string()),
])
DATA_COLUMNS = tuple(DATA_SCHEMA.names)

# One row per input row that could not be processed. `row` is the 1-based line number of a
# JSONL file, or the 1-based row number of a parquet file, Hugging Face split or demo corpus.
REJECT_SCHEMA = pa.schema([
    ("source", pa.string()), ("row", pa.int64()), ("id", pa.string()), ("reason", pa.string()),
    ("detail", pa.string()), ("raw", pa.string()), ("run_id", pa.string()),
])

# One row per scored chain, for analysis: chain token ids and text pieces, both axes
# (Eq. 7, before normalisation; null for baselines), the necessity of the facts (MIST's
# target "both"; null otherwise) and the unified score that pruning ranks.
SCORES_SCHEMA = pa.schema([
    ("id", pa.string()), ("method", pa.string()), ("model", pa.string()),
    ("token_ids", pa.list_(pa.int64())), ("tokens", pa.list_(pa.string())),
    ("necessity", pa.list_(pa.float64())), ("sufficiency", pa.list_(pa.float64())),
    ("facts_necessity", pa.list_(pa.float64())), ("scores", pa.list_(pa.float64())),
])

# ---------------------------------------------------------------- extra input columns
# Input columns the adapter does not consume are passed through to data/. Values keep their
# JSON type where it is a scalar (string, integer, float, boolean); anything else (lists,
# objects, dates read from parquet) is stored as its JSON text. Every file of a run gets the
# same column types, decided from the whole input before scoring starts.

EXTRA_PREFIX = "input_"


def extra_name(column: str) -> str:
    """The output name of an extra input column: an input column named like an output
    column (say `budget`) would collide, so it gets a prefix instead of being dropped."""
    return EXTRA_PREFIX + column if column in DATA_COLUMNS else column


def value_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "bool"
    if isinstance(value, int):
        return "int" if -2**63 <= value < 2**63 else "json"  # wider than int64: kept as text
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"


def kinds_type(kinds: Iterable[str]) -> pa.DataType:
    """The Arrow type that holds every value kind seen in one column."""
    kinds = set(kinds) - {"null"}
    if kinds == {"int"}:
        return pa.int64()
    if kinds and kinds <= {"int", "float"}:
        return pa.float64()
    if kinds == {"bool"}:
        return pa.bool_()
    return pa.string()


def extra_value(value, type_: pa.DataType):
    """A value made to fit its column's type (see kinds_type)."""
    if value is None:
        return None
    if pa.types.is_string(type_):
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                               default=str)
    if pa.types.is_floating(type_):
        return float(value)
    return value


def fits(kinds: Iterable[str], type_: pa.DataType) -> bool:
    """Whether values of these kinds can be written into an existing column of this type."""
    kinds = set(kinds) - {"null"}
    if pa.types.is_string(type_) or not kinds:
        return True
    if pa.types.is_integer(type_):
        return kinds == {"int"}
    if pa.types.is_floating(type_):
        return kinds <= {"int", "float"}
    if pa.types.is_boolean(type_):
        return kinds == {"bool"}
    return False


def data_schema(extras: pa.Schema | None = None) -> pa.Schema:
    """DATA_SCHEMA followed by the run's extra columns."""
    fields = list(DATA_SCHEMA)
    if extras is not None:
        fields += [f for f in extras if f.name not in DATA_COLUMNS]
    return pa.schema(fields)


def data_rows(*, id: str, question: str, cot: str, answer: str, budgets: Sequence[float],
              compressed: Sequence[str], kept_tokens: Sequence[int], cot_tokens: int,
              method: str, model: str, extras: dict | None = None,
              extras_schema: pa.Schema | None = None) -> list[dict]:
    """The data/ rows of one example, one per budget."""
    extra = {}
    if extras and extras_schema is not None:
        for f in extras_schema:
            extra[f.name] = extra_value(extras.get(f.name), f.type)
    return [dict(id=id, question=question, cot=cot, answer=answer, budget=float(b),
                 compressed_cot=text, kept_tokens=int(k), cot_tokens=int(cot_tokens),
                 kept_words=count_words(text), cot_words=count_words(cot),
                 method=method, model=model, **extra)
            for b, text, k in zip(budgets, compressed, kept_tokens)]


_WORD = re.compile(r"\S+")


def count_words(text: str) -> int:
    """Whitespace-separated words, as a reader counts them."""
    return len(_WORD.findall(text))


# ---------------------------------------------------------------- SFT records
# One record per (example, γ), laid out as a trainer reads it without code:
#   prompt-completion  TRL's conversational prompt-completion: `prompt` (the user turn) and
#                      `completion` (the assistant turn); SFTTrainer puts the loss on the
#                      completion only (the prompt, and any system prompt the chat template
#                      adds, carry none).
#   messages           the same two turns as one `messages` list (TRL's conversational
#                      language modeling, LLaMA-Factory's sharegpt, axolotl's chat_template).
#   alpaca             LLaMA-Factory's alpaca: instruction (the user turn), input "", output.
#   tokenskip          TokenSkip's own alpaca records (its instruction, its γ marker).
# Every record also carries `id` and `budget`; the trainers ignore columns they do not map.

SFT_FORMATS = ("prompt-completion", "messages", "alpaca", "tokenskip")
SFT_ALIASES = {"chat": "messages"}  # the messages format's earlier name
SFT_MIXES = ("sample", "all")
TOKENSKIP_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
LLAMAFACTORY_NAME = "mist"  # the dataset's name in dataset_info.json


def sft_format_name(fmt: str) -> str:
    """The format's current name (`chat` was the messages format's)."""
    return SFT_ALIASES.get(fmt, fmt)


def budget_label(budget: float) -> str:
    """0.7 -> '0.7' (no float noise), as TokenSkip writes ratios."""
    return f"{round(float(budget), 6):g}"


def directive(budget: float) -> str | None:
    """The instruction for a budget γ: 'Please reduce (1−γ)×100% of the tokens in your
    CoT.'; None at γ = 1.0, where the prompt carries no directive. The paper's wording says
    words, but γ counts tokens (⌈γ·T⌉ chain tokens are kept whatever the pruning unit, and
    whole words kept to a token budget are a smaller share of the words), so the directive
    names the unit that was reduced. The manifest reports the share kept in both units."""
    if budget >= 1.0:
        return None
    return f"Please reduce {round((1.0 - budget) * 100, 4):g}% of the tokens in your CoT."


def sft_turns(*, question: str, cot: str, answer: str, budget: float) -> tuple[str, str]:
    """The user turn (the question, plus the directive below γ = 1.0) and the assistant turn
    (the chain, then the answer line as MIST scored it)."""
    d = directive(budget)
    user = question if d is None else f"{question}\n\n{d}"
    return user, f"{cot}\n\n{ANSWER_LEAD}{answer}"


def sft_prompt_completion(*, id: str, question: str, cot: str, answer: str, budget: float) -> dict:
    user, assistant = sft_turns(question=question, cot=cot, answer=answer, budget=budget)
    return {"id": id, "budget": float(budget),
            "prompt": [{"role": "user", "content": user}],
            "completion": [{"role": "assistant", "content": assistant}]}


def sft_messages(*, id: str, question: str, cot: str, answer: str, budget: float) -> dict:
    user, assistant = sft_turns(question=question, cot=cot, answer=answer, budget=budget)
    return {"id": id, "budget": float(budget), "messages": [
        {"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def sft_alpaca(*, id: str, question: str, cot: str, answer: str, budget: float) -> dict:
    user, assistant = sft_turns(question=question, cot=cot, answer=answer, budget=budget)
    return {"id": id, "budget": float(budget), "instruction": user, "input": "",
            "output": assistant}


def sft_tokenskip(*, id: str, question: str, cot: str, answer: str, budget: float) -> dict:
    """A TokenSkip / LLaMA-Factory (alpaca) record: `{question}<|eot_id|>{γ}<|eot_id|>` as
    input, the bare question at γ = 1.0, and TokenSkip's boxed answer line."""
    inp = question if budget >= 1.0 else f"{question}<|eot_id|>{budget_label(budget)}<|eot_id|>"
    return {"id": id, "budget": float(budget), "instruction": TOKENSKIP_INSTRUCTION,
            "input": inp, "output": f"{cot}\n\nThe final answer is: $\\boxed{{{answer}}}$"}


_MAKERS = {"prompt-completion": sft_prompt_completion, "messages": sft_messages,
           "alpaca": sft_alpaca, "tokenskip": sft_tokenskip}


def llamafactory_entry(fmt: str) -> dict | None:
    """The dataset_info.json entry through which LLaMA-Factory reads sft/ (the output folder
    is then its dataset_dir); None for prompt-completion, a layout it does not read."""
    fmt = sft_format_name(fmt)
    if fmt in ("alpaca", "tokenskip"):
        return {"file_name": "sft", "formatting": "alpaca",
                "columns": {"prompt": "instruction", "query": "input", "response": "output"}}
    if fmt == "messages":
        # Every tag it uses is given: LLaMA-Factory sets a tag left out of `tags` to None.
        return {"file_name": "sft", "formatting": "sharegpt", "columns": {"messages": "messages"},
                "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                         "assistant_tag": "assistant", "system_tag": "system"}}
    return None


def sft_budgets(budgets: Sequence[float]) -> list[float]:
    """The budgets SFT data mixes: the job's budgets and γ = 1.0 (the full chain)."""
    return sorted({float(b) for b in budgets} | {1.0})


def pick_budget(key: str, choices: Sequence[float], seed: int = 0) -> float:
    """One budget per example, uniform over `choices` and fixed by the example's id (so a
    refresh run draws the same one), as TokenSkip builds its training mixture."""
    h = hashlib.sha256(f"{seed}|{key}".encode("utf-8")).digest()
    return list(choices)[int.from_bytes(h[:8], "little") % len(choices)]


def sft_records(*, id: str, question: str, cot: str, answer: str,
                compressed: dict[float, str], fmt: str = "prompt-completion", mix: str = "all",
                seed: int = 0) -> list[dict]:
    """The SFT records of one example. `compressed` maps each budget to its chain; γ = 1.0
    uses the full chain unless it was one of the budgets. mix="all": one record per γ, in
    order (the model sees each chain whole and at every budget: the better recipe on the
    testbed); mix="sample": one record, its γ drawn uniformly from the budgets and 1.0."""
    make = _MAKERS.get(sft_format_name(fmt))
    if make is None:
        raise ValueError(f"sft format must be one of {SFT_FORMATS}, not {fmt!r}")
    if mix not in SFT_MIXES:
        raise ValueError(f"sft mix must be one of {SFT_MIXES}, not {mix!r}")
    chains = {1.0: cot.strip(), **{float(b): t for b, t in compressed.items()}}
    gammas = sft_budgets(compressed)
    if mix == "sample":
        gammas = [pick_budget(id, gammas, seed)]
    return [make(id=id, question=question, cot=chains[g], answer=answer, budget=g)
            for g in gammas]
