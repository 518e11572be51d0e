"""A corpus row as the job, the evaluation and the loop commands read it: raw bytes ->
the row's examples (decoding, JSON, the adapter) and its extra columns, or an InvalidExample
with its reason; the id of a row that failed, where it can still be read; and the model's
prompt template for tokenizing. Shared so that no command imports another's internals."""
from __future__ import annotations

import functools
import json

from mist_core import InvalidExample, get_adapter
from mist_core.data.examples import Example
from mist_core.data.formats import extra_name

from .errors import ConfigError

# Columns each adapter reads; the rest of a row is passed through as extra columns.
_CONSUMED = {"gsm8k": {"question", "answer", "solution", "id"},
             "math": {"problem", "question", "solution", "answer", "id"},
             # openr1 also takes the per-generation lists (they describe every generation,
             # not the one an example holds) and `messages`, one of the generations again.
             "openr1": {"problem", "question", "answer", "uuid", "id", "generations",
                        "correctness_math_verify", "correctness_llama",
                        "is_reasoning_complete", "finish_reasons", "messages"},
             "openthoughts": {"conversations", "id"},
             # `cot` is s1K's empty (always null) chain column.
             "s1k": {"question", "thinking_trajectories", "attempt", "cot",
                     "deepseek_thinking_trajectory", "deepseek_attempt", "id"},
             "messages": {"messages", "id"}}
GENERIC_COLUMNS = {"question": "question", "cot": "cot", "answer": "answer", "id": "id"}


def consumed_columns(adapter: str, columns: dict) -> set[str]:
    if adapter == "generic":
        return set({**GENERIC_COLUMNS, **columns}.values())
    return _CONSUMED[adapter]


@functools.lru_cache(maxsize=8)
def _adapter(name: str, columns: tuple):
    return get_adapter(name, **dict(columns))


def parse_row(raw: bytes, adapter: str, columns: dict,
              error: str | None = None) -> tuple[Example, dict]:
    """Raw bytes -> (Example, extra columns), the row's first example where it gives
    several (openr1). Raises InvalidExample with a reason code."""
    examples, extras = parse_examples(raw, adapter, columns, error)
    return examples[0], extras


def parse_examples(raw: bytes, adapter: str, columns: dict,
                   error: str | None = None) -> tuple[list[Example], dict]:
    """Raw bytes -> (the row's examples, extra columns): one example, or several for an
    adapter that fans a row out (openr1: one per usable generation). Raises InvalidExample
    with a reason code. `error`: the read stage's note that the file could not be parsed
    from this row on."""
    if error is not None:
        raise InvalidExample("unreadable_file", error)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidExample("invalid_utf8", f"byte {e.start}: {e.reason}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidExample("invalid_json", str(e)) from None
    except RecursionError:  # json.loads gives up on very deep nesting this way
        raise InvalidExample("invalid_json", "nested too deeply") from None
    if not isinstance(obj, dict):
        raise InvalidExample("not_an_object", f"a JSON {type(obj).__name__}, not an object")
    if "\\u" in text:  # only an escape can make a lone surrogate; valid UTF-8 holds none
        _check_surrogates(obj)
    found = _adapter(adapter, tuple(sorted(columns.items())))(obj)
    examples = found if isinstance(found, list) else [found]
    if not examples:  # an adapter rejects a row with its reason instead
        raise RuntimeError(f"adapter {adapter} gave no example and no reason")
    return examples, _extras(obj, consumed_columns(adapter, columns))


def _extras(obj: dict, skip: set) -> dict:
    """The row's columns the adapter does not read, under their output names. Two columns
    that would get one name (`budget`, prefixed to `input_budget`, beside an `input_budget`)
    reject the row, naming both: one value would otherwise overwrite the other."""
    extras, origin = {}, {}
    for k, v in obj.items():
        if k in skip or k.startswith("__index_level_"):
            continue
        name = extra_name(k)
        if name in origin:
            raise InvalidExample("column_collision", f"columns {origin[name][:80]!r} and "
                                 f"{k[:80]!r} would both pass through as {name[:80]!r}")
        origin[name] = k
        extras[name] = v
    return extras


def _check_surrogates(obj: dict) -> None:
    """json.loads accepts an escaped lone surrogate ("\\ud800") as a str that has no UTF-8
    form: Arrow could not write it (nor the tokenizer read it), so the row stops here."""
    for k, v in obj.items():
        try:
            json.dumps([k, v], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidExample("lone_surrogate", f"column {ascii(k)}: "
                                 f"{ascii(e.object[e.start:e.end])} has no UTF-8 form") from None


# Where an adapter reads a row's id, when not from `id` (generic: its --columns mapping).
_ID_COLUMNS = {"openr1": ("id", "uuid")}


def readable_id(raw: bytes, adapter: str, columns: dict) -> str | None:
    """The id of a row that failed validation, where it can still be read (a JSON object
    whose id column holds a non-blank string or an integer), so that its reject names the
    row as the corpus does."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    names = ((columns.get("id", "id"),) if adapter == "generic"
             else _ID_COLUMNS.get(adapter, ("id",)))
    for name in names:
        value = obj.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            try:
                value.encode("utf-8")  # a lone surrogate could not be written
            except UnicodeEncodeError:
                return None
            return value
    return None


@functools.lru_cache(maxsize=4)
def template_for(model: str, template: str, trust_remote_code: bool = False):
    """The model's tokenizer in its prompt template, loaded once per worker process.
    Tokenizing needs no weights, so CPU tasks load only the tokenizer and config."""
    from transformers import AutoConfig, AutoTokenizer

    from mist_core.data.templates import get_template
    from mist_core.models import resolve

    source, _ = resolve(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ValueError as e:
        refused = remote_code_refused(model, e)
        if refused is None:
            raise
        raise refused from None
    max_len = getattr(config, "max_position_embeddings", None)
    tmpl = get_template(template, tokenizer, int(max_len) if max_len else 2048)
    tmpl.prefix("probe")  # a template that cannot render fails the job here, not every row
    return tmpl


def remote_code_refused(model: str, e: Exception) -> ConfigError | None:
    """transformers' refusal to run a model folder's own code (trust_remote_code=False,
    which every load passes: left unset, transformers would ask on stdin, and a `y` would
    run it) as one line naming the flag; None for any other error."""
    if isinstance(e, ValueError) and "trust_remote_code" in str(e):
        return ConfigError(f"--model {model} holds Python code of its own (auto_map in its "
                           "config), which runs only with --trust-remote-code")
    return None
