"""Long chain-of-thought corpora: the adapters for OpenR1-Math, OpenThoughts / Bespoke-Stratos,
s1K and chat rows (rows built here in each dataset's published schema), the thinking template
(Qwen3- and DeepSeek-R1-like chat templates on the test tokenizer), and each format through
the compression job end to end, with exact counts and ids."""
from __future__ import annotations

import copy
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import make_model
from mist_core import InvalidExample, get_adapter, get_template
from mist_core.data.examples import stable_id
from mist_core.data.longcot import split_thinking
from mist_core.data.templates import ANSWER_LEAD, ChatTemplate, ThinkTemplate
from pipelines.job import compress
from pipelines.common import storage
from pipelines.common.rows import parse_examples, parse_row

Q = "Janet has 16 eggs and eats 3. How many are left?"
THINK = "She has 16 eggs. She eats 3, so 16 - 3 = 13 eggs are left."
SOLUTION = "Janet has 16 - 3 = 13 eggs left. The answer is $\\boxed{13}$."


def r1_trace(thinking: str = THINK, solution: str = SOLUTION) -> str:
    return f"<think>\n{thinking}\n</think>\n\n{solution}"


def openr1_row(uuid="u1", n=3, **changes) -> dict:
    """An OpenR1-Math-220k row (open-r1/OpenR1-Math-220k, default split)."""
    row = {"problem": Q, "solution": "16 - 3 = 13", "answer": "13", "problem_type": "Algebra",
           "question_type": "math-word-problem", "source": "olympiads", "uuid": uuid,
           "is_reasoning_complete": [True] * n, "generations": [r1_trace()] * n,
           "correctness_math_verify": [True] * n, "correctness_llama": None,
           "finish_reasons": None, "correctness_count": n,
           "messages": [{"role": "user", "content": Q},
                        {"role": "assistant", "content": r1_trace()}]}
    row.update(changes)
    return row


SYSTEM = "Your role as an assistant involves thoroughly exploring questions ..."


def stratos(thinking: str = THINK, solution: str = SOLUTION) -> str:
    return (f"<|begin_of_thought|>\n\n{thinking}\n\n<|end_of_thought|>\n\n"
            f"<|begin_of_solution|>\n\n{solution}\n\n<|end_of_solution|>")


def openthoughts_row(question=Q, reply=None, roles=("user", "assistant")) -> dict:
    """An OpenThoughts-114k / Bespoke-Stratos-17k row."""
    return {"system": SYSTEM, "conversations": [
        {"from": roles[0], "value": question},
        {"from": roles[1], "value": stratos() if reply is None else reply}]}


def s1k_row(**changes) -> dict:
    """A simplescaling/s1K row."""
    row = {"solution": "13", "question": Q, "cot_type": "math", "source_type": "gsm8k",
           "metadata": "{}", "cot": None,
           "thinking_trajectories": ["She has 16 eggs.", "She eats 3, so 16 - 3 = 13."],
           "attempt": "16 - 3 = 13\n\nFinal Answer: The final answer is $\\boxed{13}$"}
    row.update(changes)
    return row


def chat_row(*turns, **extra) -> dict:
    return {"messages": [dict(zip(("role", "content"), t)) if isinstance(t, tuple) else t
                         for t in turns], **extra}


def reason_of(adapter: str, row: dict) -> InvalidExample:
    with pytest.raises(InvalidExample) as err:
        get_adapter(adapter)(row)
    return err.value

# ------------------------------------------------------------------ adapters


def test_split_thinking_reads_both_markups():
    assert split_thinking(r1_trace()) == (THINK, SOLUTION)
    assert split_thinking(stratos()) == (THINK, SOLUTION)
    # R1 chat templates open the block in the prompt: a trace may start inside it.
    assert split_thinking(f"{THINK}\n</think>\n\n{SOLUTION}") == (THINK, SOLUTION)
    with pytest.raises(InvalidExample, match="no_thinking_block"):
        split_thinking(f"<think>\n{THINK} and it never closes")


def test_openr1_one_example_per_correct_complete_generation():
    row = openr1_row(n=5, generations=[
        r1_trace(), r1_trace("Wrong: 16 + 3 = 19."), r1_trace("Cut off"),
        r1_trace("By the judge: 13.", "So 13 eggs remain."), r1_trace("Second: 13 left.")],
        correctness_math_verify=[True, False, True, False, True],
        correctness_llama=[None, False, None, True, None],
        is_reasoning_complete=[True, True, False, True, True])
    exs = get_adapter("openr1")(row)
    assert [e.id for e in exs] == ["u1#0", "u1#3", "u1#4"]  # generation index, not rank
    assert [(e.question, e.cot, e.answer) for e in exs] == [
        (Q, THINK, "13"),
        (Q, "By the judge: 13.", "13"),  # no \boxed{}: the reference it was verified against
        (Q, "Second: 13 left.", "13")]
    # An `id` column names the row where there is one; without id or uuid, a hash of the texts.
    assert [e.id for e in get_adapter("openr1")(openr1_row(n=1, id=7))] == ["7#0"]
    no_id = get_adapter("openr1")({k: v for k, v in openr1_row(n=2).items() if k != "uuid"}
                                  | {"generations": [r1_trace(), r1_trace("Other: 13.")]})
    assert [e.id for e in no_id] == [None, None]
    assert [e.key for e in no_id] == [stable_id(Q, THINK, "13"), stable_id(Q, "Other: 13.", "13")]


@pytest.mark.parametrize("changes, reason, detail", [
    (dict(correctness_math_verify=[False, False], is_reasoning_complete=[True, False], n=2),
     "no_correct_generation", "0: not marked correct; 1: not marked correct"),
    (dict(correctness_math_verify=[True, True], is_reasoning_complete=[False, False], n=2),
     "no_correct_generation", "0: reasoning incomplete; 1: reasoning incomplete"),
    (dict(generations=["no block here \\boxed{13}"], n=1), "no_correct_generation",
     "0: no_thinking_block"),
    (dict(generations=[r1_trace(" ")], n=1), "no_correct_generation", "0: empty_cot"),
    (dict(generations=[], correctness_math_verify=[], n=0), "no_correct_generation",
     "no generations"),
    (dict(generations=r1_trace(), n=1), "malformed_generations", "list of strings"),
    (dict(correctness_math_verify=[True], n=2), "malformed_generations", "list of 2 booleans"),
    (dict(correctness_math_verify=None, n=2), "missing_column", "correctness_math_verify"),
    (dict(problem=None, n=1), "missing_column", "problem"),
    (dict(uuid="", n=1), "empty_id", ""),
])
def test_openr1_rejects_a_row_with_no_usable_generation(changes, reason, detail):
    n = changes.pop("n")
    err = reason_of("openr1", openr1_row(n=n, **changes))
    assert err.reason == reason and detail in err.detail


def test_openthoughts_and_bespoke_stratos():
    ex = get_adapter("openthoughts")(openthoughts_row())
    assert (ex.question, ex.cot, ex.answer, ex.id) == (Q, THINK, "13", None)
    # ShareGPT role names, and a solution without its closing marker
    ex = get_adapter("openthoughts")(openthoughts_row(
        roles=("human", "gpt"), reply=stratos().replace("\n\n<|end_of_solution|>", "")))
    assert (ex.cot, ex.answer) == (THINK, "13")


@pytest.mark.parametrize("row, reason", [
    (openthoughts_row(reply=stratos(solution="def f(): return 13")), "no_final_answer"),
    (openthoughts_row(reply=f"{THINK}\n\n{SOLUTION}"), "no_thinking_block"),
    (openthoughts_row(reply=stratos(thinking="")), "empty_cot"),
    (openthoughts_row(question=""), "empty_question"),
    ({"system": SYSTEM, "conversations": [{"from": "user", "value": Q}]},
     "malformed_conversations"),
    ({"conversations": [{"from": "assistant", "value": stratos()},
                        {"from": "user", "value": Q}]}, "malformed_conversations"),
    ({"conversations": "text"}, "malformed_conversations"),
    ({"system": SYSTEM}, "missing_column"),
    (openthoughts_row(reply=["a list"]), "cot_not_string"),
])
def test_openthoughts_bad_rows(row, reason):
    assert reason_of("openthoughts", row).reason == reason


def test_s1k_and_s1k_1_1():
    ex = get_adapter("s1k")(s1k_row())
    assert (ex.question, ex.cot, ex.answer) == (Q, "She has 16 eggs.\nShe eats 3, so 16 - 3 = 13.",
                                                "13")
    v11 = {k: v for k, v in s1k_row().items() if k not in ("cot", "thinking_trajectories",
                                                           "attempt")}
    v11 |= {"gemini_thinking_trajectory": "other", "gemini_attempt": "\\boxed{12}",
            "deepseek_thinking_trajectory": THINK, "deepseek_attempt": SOLUTION}
    ex = get_adapter("s1k")(v11)
    assert (ex.cot, ex.answer) == (THINK, "13")


@pytest.mark.parametrize("changes, reason", [
    (dict(attempt="By induction the claim holds for every n."), "no_final_answer"),
    (dict(attempt="\\boxed{ }"), "no_final_answer"),
    (dict(thinking_trajectories=[1, 2]), "cot_not_string"),
    (dict(thinking_trajectories=["  "]), "empty_cot"),
    (dict(attempt=None), "missing_column"),
    (dict(thinking_trajectories=None), "missing_column"),
    (dict(question=3), "question_not_string"),
])
def test_s1k_bad_rows(changes, reason):
    assert reason_of("s1k", s1k_row(**changes)).reason == reason


def test_messages_rows():
    ex = get_adapter("messages")(chat_row(("system", "Be brief."), ("user", Q),
                                          ("assistant", r1_trace()), id="m1"))
    assert (ex.question, ex.cot, ex.answer, ex.id) == (Q, THINK, "13", "m1")
    # The thinking in its own field, as Qwen3's chat template and DeepSeek's API carry it
    ex = get_adapter("messages")(chat_row(("user", Q), {"role": "assistant", "content": SOLUTION,
                                                        "reasoning_content": f"\n{THINK}\n"}))
    assert (ex.cot, ex.answer) == (THINK, "13")


@pytest.mark.parametrize("row, reason", [
    (chat_row(("user", "Hi"), ("assistant", "Hello"), ("user", Q), ("assistant", r1_trace())),
     "malformed_messages"),  # earlier turns are context the question alone would lose
    (chat_row(("user", Q)), "malformed_messages"),
    (chat_row(("user", Q), ("system", "late"), ("assistant", r1_trace())), "malformed_messages"),
    (chat_row(("user", Q), ("assistant", SOLUTION)), "no_thinking_block"),
    (chat_row(("user", Q), ("assistant", r1_trace(solution="Thirteen."))), "no_final_answer"),
    (chat_row(("user", [{"type": "text", "text": Q}]), ("assistant", r1_trace())),
     "question_not_string"),
    ({"conversation": []}, "missing_column"),
])
def test_messages_bad_rows(row, reason):
    assert reason_of("messages", row).reason == reason


def test_parse_examples_fans_out_and_passes_other_columns_through():
    raw = json.dumps(openr1_row(n=2)).encode()
    exs, extras = parse_examples(raw, "openr1", {})
    assert [e.id for e in exs] == ["u1#0", "u1#1"]
    # per-generation lists (and `messages`, a generation again) stay out; the rest passes
    assert extras == {"solution": "16 - 3 = 13", "problem_type": "Algebra", "source": "olympiads",
                      "question_type": "math-word-problem", "correctness_count": 2}
    assert parse_row(raw, "openr1", {})[0] == exs[0]
    _, extras = parse_examples(json.dumps(openthoughts_row()).encode(), "openthoughts", {})
    assert extras == {"system": SYSTEM}
    _, extras = parse_examples(json.dumps(s1k_row()).encode(), "s1k", {})
    assert set(extras) == {"solution", "cot_type", "source_type", "metadata"}

# ------------------------------------------------------------------ thinking template

# Qwen3's chat template, cut to what a one-question conversation uses (the reasoning is split
# from the content at </think> and re-rendered inside the assistant's <think> block).
QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")

# DeepSeek-R1-Distill's: a rendered assistant turn keeps only what follows </think>, and the
# generation prompt opens the thinking block.
R1_DISTILL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '<｜User｜>' + m['content'] }}{% elif m['role'] == 'assistant' %}"
    "{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


def thinking_tokenizer(tokenizer, chat_template: str):
    """The test tokenizer with <think> and </think> as whole tokens (as in Qwen3's
    vocabulary) and the given chat template."""
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def qwen3_tok(tokenizer):
    return thinking_tokenizer(tokenizer, QWEN3)


@pytest.fixture(scope="module")
def r1_tok(tokenizer):
    return thinking_tokenizer(tokenizer, R1_DISTILL)


def test_auto_picks_the_thinking_template(qwen3_tok, r1_tok, tokenizer):
    assert isinstance(get_template("auto", qwen3_tok), ThinkTemplate)
    assert isinstance(get_template("auto", r1_tok), ThinkTemplate)
    assert type(get_template("auto", tokenizer)) is ChatTemplate  # ChatML: no thinking block


@pytest.mark.parametrize("which", ["qwen3", "r1"])
def test_think_template_scores_the_chain_inside_the_thinking_block(which, qwen3_tok, r1_tok,
                                                                   examples):
    tok = qwen3_tok if which == "qwen3" else r1_tok
    template = get_template("think", tok, max_length=256)
    for ex in examples:
        enc = template.encode(ex)
        text = tok.decode(enc.source_ids)
        # exactly the text the model writes: its prompt, the chain in its thinking block,
        # the answer line after the block
        if which == "qwen3":  # the model's own template renders that very turn
            turn = {"role": "assistant",
                    "content": f"<think>\n{ex.cot}\n</think>\n\n{ANSWER_LEAD}{ex.answer}"}
            rendered = tok.apply_chat_template([{"role": "user", "content": ex.question}, turn],
                                               tokenize=False)
            assert rendered == text + "<|im_end|>\n"
        else:  # the generation prompt opens the block; R1 writes the answer after </think>
            prompt = tok.apply_chat_template([{"role": "user", "content": ex.question}],
                                             tokenize=False, add_generation_prompt=True)
            assert prompt.endswith("<｜Assistant｜><think>\n")
            assert text == f"{prompt}{ex.cot}\n</think>\n\n{ANSWER_LEAD}{ex.answer}"
        chain = enc.source_ids[enc.chain_start:enc.chain_stop]
        assert tok.decode(chain) == ex.cot
        assert tok.convert_ids_to_tokens(int(enc.source_ids[enc.chain_start - 1])) != "</think>"
        assert "<think>" in tok.decode(enc.source_ids[:enc.chain_start])
        assert tok.decode(enc.source_ids[enc.chain_stop:enc.answer_start]) == \
            "\n</think>\n\n" + ANSWER_LEAD.rstrip()
        assert tok.decode(enc.source_ids[enc.answer_start:]).strip() == ex.answer
        # no chain: an empty thinking block (Qwen3 with thinking off), then the same answer line
        t_text = tok.decode(enc.target_ids)
        assert t_text == text.replace(ex.cot, "", 1)
        assert "<think>\n\n</think>\n\n" + ANSWER_LEAD in t_text
        n = enc.answer_len
        assert list(enc.target_ids[enc.target_final + 1:]) == list(enc.source_ids[-n:])


def test_think_template_scores(qwen3_tok, examples):
    """A model scores through the thinking template like any other (finite, one per token)."""
    from mist_core import MistScorer
    from mist_core.models import wrap_model

    lm = wrap_model(make_model("qwen2", len(qwen3_tok)), qwen3_tok, "tiny-qwen3ish")
    scored = MistScorer(lm, template="think").score(examples)
    for ex, s in zip(examples, scored):
        assert qwen3_tok.decode(s.source_ids[s.chain_start:s.chain_start + len(s.scores)]) == ex.cot
        assert np.all(np.isfinite(s.scores)) and np.any(s.scores != s.scores[0])

# ------------------------------------------------------------------ the job, end to end

BUDGETS = "0.5,0.8"


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory, qwen3_tok):
    """A tiny Qwen2 model (context 256) with the Qwen3-like tokenizer: `auto` scores the
    chains in its thinking block."""
    path = tmp_path_factory.mktemp("model") / "tiny-qwen3ish"
    make_model("qwen2", len(qwen3_tok)).save_pretrained(path)
    qwen3_tok.save_pretrained(path)
    return path


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def run_job(corpus, out, model, adapter: str, *extra: str) -> dict:
    """The job as `python -m pipelines.compress` runs it (its main, on the test's Ray)."""
    argv = ["--input", str(corpus), "--output", str(out), "--model", str(model),
            "--adapter", adapter, "--budgets", BUDGETS, "--unit", "token", "--batch-size", "8",
            *extra]
    assert compress.main(argv) == 0
    return json.loads((out / "_manifest.json").read_text())


def read_dir(out, sub: str) -> list[dict]:
    fs, root, _ = storage.filesystem(str(out / sub))
    table = storage.read_parquet_dir(fs, root)
    return [] if table is None else table.to_pylist()


def check_counts(manifest: dict, **want) -> None:
    c = manifest["counts"]
    assert {k: c[k] for k in want} == want, c


def ids_per_budget(out) -> dict:
    data = read_dir(out, "data")
    return {b: sorted(r["id"] for r in data if r["budget"] == b) for b in (0.5, 0.8)}


@pytest.mark.integration
def test_openr1_through_the_job(local_ray, qwen3_model, tmp_path):
    """A folder of OpenR1 parquet (as published) and JSONL: rows fan out to one example per
    correct generation, every example and row has one fate, and a rerun writes nothing."""
    corpus = tmp_path / "openr1"
    corpus.mkdir()
    long_trace = r1_trace(" ".join(["step"] * 400))
    rows = [
        # -> u1#0, u1#2
        openr1_row("u1", 3, generations=[r1_trace(), r1_trace("Wrong: 19."), r1_trace("Also 13.")],
                   correctness_math_verify=[True, False, True]),
        # -> no_correct_generation
        openr1_row("u2", 2, correctness_math_verify=[False, True],
                   is_reasoning_complete=[True, False]),
        # -> u3#0 scored; u3#1 too_long
        openr1_row("u3", 2, generations=[r1_trace(), long_trace]),
        # -> u1#0 again: duplicate_id
        openr1_row("u1", 1),
    ]
    pq.write_table(pa.Table.from_pylist(rows), corpus / "a.parquet")
    write_jsonl(corpus / "b.jsonl", [
        openr1_row("u5", 1, generations=r1_trace()),                       # malformed_generations
        {k: v for k, v in openr1_row("u6", 1).items() if k != "correctness_math_verify"},
        "not json",
    ])
    out = tmp_path / "out"
    manifest = run_job(corpus, out, qwen3_model, "openr1")
    check_counts(manifest, read=7, examples=9, scored=3, rejected=6, already_done=0)
    assert manifest["counts"]["rejected_by_reason"] == {
        "duplicate_id": 1, "invalid_json": 1, "malformed_generations": 1, "missing_column": 1,
        "no_correct_generation": 1, "too_long": 1}
    assert ids_per_budget(out) == {b: ["u1#0", "u1#2", "u3#0"] for b in (0.5, 0.8)}
    data = {r["id"]: r for r in read_dir(out, "data") if r["budget"] == 0.5}
    assert (data["u1#2"]["question"], data["u1#2"]["cot"], data["u1#2"]["answer"]) == \
        (Q, "Also 13.", "13")
    assert data["u1#0"]["source"] == "olympiads" and data["u1#0"]["correctness_count"] == 3
    assert "generations" not in data["u1#0"] and "messages" not in data["u1#0"]
    rejects = {(r["source"].rsplit("/", 1)[1], r["row"]): r for r in read_dir(out, "rejects")}
    assert {k: r["reason"] for k, r in rejects.items()} == {
        ("a.parquet", 2): "no_correct_generation", ("a.parquet", 3): "too_long",
        ("a.parquet", 4): "duplicate_id", ("b.jsonl", 1): "malformed_generations",
        ("b.jsonl", 2): "missing_column", ("b.jsonl", 3): "invalid_json"}
    assert "0: not marked correct; 1: reasoning incomplete" in \
        rejects[("a.parquet", 2)]["detail"]
    assert json.loads(rejects[("a.parquet", 2)]["raw"])["uuid"] == "u2"  # the row, as read
    # one generation of a row that gave two: its own record, holding that generation alone
    too_long = rejects[("a.parquet", 3)]
    assert too_long["id"] == "u3#1" and json.loads(too_long["raw"])["id"] == "u3#1"
    assert rejects[("a.parquet", 4)]["id"] == "u1#0"

    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    again = run_job(corpus, out, qwen3_model, "openr1")
    # the duplicate's id is in data/ now, so it counts as already done
    check_counts(again, read=7, examples=9, scored=0, rejected=5, already_done=4,
                 rejects_already_recorded=5, files_written=0)
    assert sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file()) == files
    assert ids_per_budget(out) == {b: ["u1#0", "u1#2", "u3#0"] for b in (0.5, 0.8)}


@pytest.mark.integration
def test_openthoughts_through_the_job(local_ray, qwen3_model, tmp_path):
    corpus = tmp_path / "openthoughts.jsonl"
    write_jsonl(corpus, [
        openthoughts_row(),
        openthoughts_row("Tom runs 5 miles a day. How far in 7 days?", roles=("human", "gpt"),
                         reply=stratos("Each day is 5 miles, so 5 * 7 = 35.", "\\boxed{35}")),
        openthoughts_row(reply=stratos(solution="```python\nprint(13)\n```")),
        {"system": SYSTEM, "conversations": [{"from": "user", "value": Q}]},
    ])
    out = tmp_path / "out"
    manifest = run_job(corpus, out, qwen3_model, "openthoughts")
    check_counts(manifest, read=4, examples=4, scored=2, rejected=2, already_done=0)
    assert manifest["counts"]["rejected_by_reason"] == {"malformed_conversations": 1,
                                                        "no_final_answer": 1}
    want = sorted([stable_id(Q, THINK, "13"), stable_id(
        "Tom runs 5 miles a day. How far in 7 days?", "Each day is 5 miles, so 5 * 7 = 35.", "35")])
    assert ids_per_budget(out) == {0.5: want, 0.8: want}
    assert {r["system"] for r in read_dir(out, "data")} == {SYSTEM}


@pytest.mark.integration
def test_s1k_through_the_job(local_ray, qwen3_model, tmp_path):
    corpus = tmp_path / "s1k"
    corpus.mkdir()
    pq.write_table(pa.Table.from_pylist([
        s1k_row(),
        s1k_row(question="Prove it.", attempt="It holds by induction."),  # no_final_answer
    ]), corpus / "s1k.parquet")
    write_jsonl(corpus / "s1k-1.1.jsonl", [{
        "question": "Tom runs 5 miles a day. How far in 7 days?", "solution": "35",
        "deepseek_thinking_trajectory": "Each day is 5 miles, so 5 * 7 = 35.",
        "deepseek_attempt": "He runs $\\boxed{35}$ miles.", "id": "s11-1"}])
    out = tmp_path / "out"
    manifest = run_job(corpus, out, qwen3_model, "s1k")
    check_counts(manifest, read=3, examples=3, scored=2, rejected=1, already_done=0)
    assert manifest["counts"]["rejected_by_reason"] == {"no_final_answer": 1}
    want = sorted(["s11-1", stable_id(Q, "She has 16 eggs.\nShe eats 3, so 16 - 3 = 13.", "13")])
    assert ids_per_budget(out) == {0.5: want, 0.8: want}


@pytest.mark.integration
def test_messages_through_the_job(local_ray, qwen3_model, tmp_path):
    corpus = tmp_path / "chat.jsonl"
    write_jsonl(corpus, [
        chat_row(("system", "Be brief."), ("user", Q), ("assistant", r1_trace()), id="m1"),
        chat_row(("user", Q), {"role": "assistant", "content": "\\boxed{13}",
                               "reasoning_content": "16 - 3 = 13."}, id="m2"),
        chat_row(("user", "Hi"), ("assistant", "Hello"), ("user", Q), ("assistant", r1_trace()),
                 id="m3"),
        chat_row(("user", Q), ("assistant", SOLUTION), id="m4"),
    ])
    out = tmp_path / "out"
    manifest = run_job(corpus, out, qwen3_model, "messages")
    check_counts(manifest, read=4, examples=4, scored=2, rejected=2, already_done=0)
    assert manifest["counts"]["rejected_by_reason"] == {"malformed_messages": 1,
                                                        "no_thinking_block": 1}
    assert ids_per_budget(out) == {0.5: ["m1", "m2"], 0.8: ["m1", "m2"]}
    data = {r["id"]: r for r in read_dir(out, "data") if r["budget"] == 0.8}
    assert (data["m2"]["cot"], data["m2"]["answer"]) == ("16 - 3 = 13.", "13")
