import json
from pathlib import Path

import pytest

from mist_core import Example, InvalidExample, MistScorer, get_adapter, get_template
from mist_core.data.examples import last_boxed, stable_id

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_gsm8k_adapter_on_a_real_row():
    row = json.loads((DATA / "gsm8k" / "test.jsonl").open().readline())
    ex = get_adapter("gsm8k")(row)
    assert ex.answer == "18"
    assert "<<" not in ex.cot and ">>" not in ex.cot and "####" not in ex.cot
    assert ex.cot.startswith("Janet sells 16 - 3 - 4 = 9 duck eggs a day.")
    assert ex.question == row["question"]


def test_math_adapter_takes_the_last_boxed_answer():
    rows = [json.loads(line) for line in (DATA / "math500" / "test.jsonl").open()][:3]
    exs = [get_adapter("math")(r) for r in rows]
    assert exs[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert exs[2].answer == "\\frac{14}{3}"
    assert all("The answer is:" not in e.cot for e in exs)
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_generic_adapter_maps_columns_and_ids():
    adapt = get_adapter("generic", question="q", cot="reasoning", answer="a", id="uid")
    ex = adapt({"q": "Q?", "reasoning": "think", "a": "4", "uid": 7})
    assert (ex.question, ex.cot, ex.answer, ex.id) == ("Q?", "think", "4", "7")
    with pytest.raises(InvalidExample) as err:
        adapt({"q": "Q?", "a": "4"})
    assert err.value.reason == "missing_column"


@pytest.mark.parametrize("row,reason", [
    ({"question": "q", "answer": "no final line"}, "no_final_answer"),
    ({"question": "q", "answer": 5}, "answer_not_string"),
    ({"answer": "x #### 1"}, "missing_column"),
    ({"question": "", "answer": "x #### 1"}, "empty_question"),
    ({"question": "q", "answer": "#### 1"}, "empty_cot"),
    ({"question": "q", "answer": "x ####  "}, "empty_answer"),
    ({"question": "q\x00", "answer": "x #### 1"}, "null_byte_in_question"),
    ({"question": "q", "answer": "x #### 1", "id": 1.5}, "id_not_string"),
])
def test_bad_rows_raise_invalid_example_with_a_reason(row, reason):
    with pytest.raises(InvalidExample) as err:
        get_adapter("gsm8k")(row)
    assert err.value.reason == reason


def test_example_validation_and_stable_id():
    with pytest.raises(InvalidExample, match="cot_not_string"):
        Example("q", None, "a")
    with pytest.raises(InvalidExample, match="empty_answer"):
        Example("q", "c", "  \n")
    a, b = Example("q", "c", "a"), Example("q", "c", "a")
    assert a.key == b.key == stable_id("q", "c", "a") and len(a.key) == 32
    assert Example("q", "c", "a", id="x").key == "x"
    assert Example("q", "c ", "a").key != a.key


@pytest.mark.parametrize("name", ["chat", "plain"])
def test_templates_record_exact_spans(tokenizer, examples, name):
    template = get_template(name, tokenizer, max_length=256)
    for ex in examples:
        enc = template.encode(ex)
        chain = enc.source_ids[enc.chain_start:enc.chain_stop]
        assert tokenizer.decode(chain) == ex.cot
        assert tokenizer.decode(enc.source_ids[enc.answer_start:]).strip() == ex.answer
        assert enc.answer_stop == len(enc.source_ids)
        # the no-chain input ends in the same answer tokens, right after its final position
        n = enc.answer_len
        assert list(enc.target_ids[enc.target_final + 1:]) == list(enc.source_ids[-n:])
        assert enc.target_final == len(enc.target_ids) - n - 1
        # the question part is shared, the chain is absent from the no-chain input
        assert enc.prefix_len <= enc.chain_start
        assert ex.question in tokenizer.decode(enc.source_ids[:enc.prefix_len])
        assert ex.cot not in tokenizer.decode(enc.target_ids)
        for (s, e), tid in zip(enc.chain_offsets, chain):
            assert ex.cot[s:e] == tokenizer.decode([tid])
    assert template.name == name


def test_chat_template_places_the_question_in_the_user_turn(tokenizer, examples):
    enc = get_template("auto", tokenizer).encode(examples[0])
    text = tokenizer.decode(enc.source_ids)
    assert text.startswith("<|im_start|>user\n" + examples[0].question + "<|im_end|>\n<|im_start|>assistant\n")
    assert text.endswith(examples[0].cot + "\n\nThe answer is 13")


def test_unscorable_examples_raise_typed_errors(tiny_lm):
    scorer = MistScorer(tiny_lm)
    with pytest.raises(InvalidExample) as err:
        scorer.score([Example("q?", "word " * 400, "1")])
    assert err.value.reason == "too_long" and "256" in str(err.value)
    with pytest.raises(InvalidExample) as err:
        scorer.score([Example("q?", "a chain", "\u200b\u200b")])  # the tokenizer drops ZWSP
    assert err.value.reason == "answer_no_tokens"
    with pytest.raises(InvalidExample) as err:
        scorer.score([Example("q?", "\u200b", "1")])
    assert err.value.reason == "cot_no_tokens"


def test_unknown_template_and_adapter():
    with pytest.raises(ValueError, match="unknown template"):
        get_template("fancy", None)
    with pytest.raises(ValueError, match="unknown adapter"):
        get_adapter("csv")
