"""The distillation loop: prompts, decoding, solving, summaries and fine-tuning on tiny models
(mist_core.distill.generation, mist_core.distill.finetune), then `mist generate` →
`mist compress` → `mist train` (in-process and under Ray Train) → `mist solve` end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_model
from mist_core.data.formats import directive, sft_messages, sft_prompt_completion
from mist_core.data.templates import ANSWER_LEAD
from mist_core.distill import generation as G
from mist_core.models import wrap_model


@pytest.fixture(scope="module")
def lm(tokenizer):
    return wrap_model(make_model("llama", len(tokenizer)), tokenizer, "tiny-llama")


# ---------------------------------------------------------------- prompts


def test_prompt_is_the_sft_user_turn_through_the_chat_template(lm, tokenizer):
    q = "Tom runs 5 miles a day. How far in 7 days?"
    assert G.prompt_text(lm, q) == f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    half = G.prompt_text(lm, q, 0.5)
    assert f"{q}\n\n{directive(0.5)}" in half and half.endswith("<|im_start|>assistant\n")
    # exactly the prefix TRL trains on: the record's prompt rendered with the generation prompt
    rec = sft_prompt_completion(id="a", question=q, cot="c", answer="35", budget=0.5)
    assert half == tokenizer.apply_chat_template(rec["prompt"], tokenize=False,
                                                 add_generation_prompt=True)


def test_plain_prompt_without_a_chat_template(tokenizer):
    plain = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer,
                                eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                bos_token="<|im_start|>")
    assert not G.has_chat_template(plain)
    text = G.render_prompt(plain, G.user_turn("What is 2 + 2?", 0.7))
    assert text == f"Question: What is 2 + 2?\n\n{directive(0.7)}\nSolution:\n"
    # as TRL tokenizes a plain-text prompt: the tokenizer's own call, its special tokens included
    assert G.encode_prompt(plain, text) == plain(text=text)["input_ids"]
    assert G.encode_prompt(tokenizer, "x") == tokenizer("x", add_special_tokens=False)["input_ids"]


def test_split_completion():
    assert G.split_completion("2 + 2 = 4.\n\nThe answer is 4") == ("2 + 2 = 4.", "4")
    # the last answer line counts; a chain without one is all chain
    assert G.split_completion(f"{ANSWER_LEAD}3, no.\n{ANSWER_LEAD} 5 ") == (f"{ANSWER_LEAD}3, no.", "5")
    assert G.split_completion(" no answer here ") == ("no answer here", None)


# ---------------------------------------------------------------- decoding


def test_generate_is_deterministic_and_does_not_depend_on_the_batch(lm):
    prompts = [G.prompt_text(lm, q) for q in ("What is 2 + 2?", "Janet has 16 eggs.",
                                              "Tom runs 5 miles a day for 7 days.")]
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.95, num_samples=3, seed=1)
    a = G.generate(lm, prompts, batch_size=4, **kw)
    assert [len(x) for x in a] == [3, 3, 3]
    assert a == G.generate(lm, prompts, batch_size=4, **kw)
    # each prompt's samples, decoded alone or in another batch, are the same
    assert G.generate(lm, prompts[1:2], batch_size=1, **kw) == a[1:2]
    assert len({c.text for x in a for c in x}) > 3  # samples differ between draws
    assert G.generate(lm, prompts, batch_size=4, **{**kw, "seed": 2}) != a
    for c in (c for x in a for c in x):
        assert 0 <= c.tokens <= 12 and (c.finished or c.tokens == 12)


def test_greedy_is_plain_argmax_decoding(lm):
    """Greedy generate against a hand-written argmax loop, left padding included."""
    prompts = [G.prompt_text(lm, "What is 2 + 2?"), G.prompt_text(lm, "Janet has 16 eggs and eats 3.")]
    got = G.generate(lm, prompts, max_new_tokens=8, batch_size=2, num_samples=2)
    eos = set(G._eos_ids(lm))
    for p, (c, c2) in zip(prompts, got):
        assert c == c2  # greedy: one decoding, repeated
        ids = torch.tensor([G.encode_prompt(lm.tokenizer, p)])
        toks = []
        with torch.no_grad():
            for _ in range(8):
                nxt = int(lm.model(ids).logits[0, -1].argmax())
                if nxt in eos:
                    break
                toks.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert c.text == lm.tokenizer.decode(toks, skip_special_tokens=True)
        assert c.tokens == len(toks) and c.finished == (len(toks) < 8)


def test_gumbel_noise_samples_from_the_softmax():
    """argmax(logits + Gumbel noise), one generator per row, is a draw from softmax(logits);
    a token the warpers removed (-inf) is never drawn."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(4000, -1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    drawn = G._GumbelNoise(gens)(None, logits).argmax(-1)
    freq = torch.bincount(drawn, minlength=5) / 4000
    assert freq[4] == 0 and torch.allclose(freq, probs, atol=0.03), freq


def test_sampling_stays_in_the_nucleus(lm):
    """Through generate: the first token drawn under top-p is always inside the nucleus of
    softmax(logits / T), and the draws spread over it."""
    from transformers.generation import TemperatureLogitsWarper, TopPLogitsWarper

    prompt = G.prompt_text(lm, "What is 2 + 2?")
    ids = torch.tensor([G.encode_prompt(lm.tokenizer, prompt)])
    with torch.no_grad():
        logits = lm.model(ids).logits[0, -1:].float()
    p = torch.softmax(TopPLogitsWarper(0.05)(ids, TemperatureLogitsWarper(0.7)(ids, logits)), -1)[0]
    nucleus = {lm.tokenizer.decode([t]) for t in range(len(p)) if p[t] > 0}
    draws = G.generate(lm, [prompt], max_new_tokens=1, temperature=0.7, top_p=0.05,
                       num_samples=200, batch_size=100)[0]
    seen = {c.text for c in draws}
    assert seen <= nucleus and len(seen) >= min(3, len(nucleus)), (seen, nucleus)


# ---------------------------------------------------------------- the loop's uses


ROWS = [{"id": "a", "question": "What is 2 + 2?", "answer": "4"},
        {"id": "b", "question": "Janet has 16 eggs and eats 3. How many are left?", "answer": "13"}]


def test_sample_chains_rows(lm):
    from mist_core.measures.answers import answer_correct

    out = G.sample_chains(lm, ROWS, k=3, style="gsm8k", max_new_tokens=10, seed=0)
    assert [r["id"] for r in out] == ["a#0", "a#1", "a#2", "b#0", "b#1", "b#2"]
    assert out == G.sample_chains(lm, ROWS, k=3, style="gsm8k", max_new_tokens=10, seed=0)
    for r in out:
        assert r["source_id"] == r["id"].split("#")[0]
        assert r["answer"] == {"a": "4", "b": "13"}[r["source_id"]]  # the gold answer
        assert r["correct"] is (r["prediction"] is not None
                                and answer_correct(r["prediction"], r["answer"], "gsm8k"))


def test_sample_chains_judges_answers(lm, monkeypatch):
    """What the model wrote is split at the answer line and judged against the gold."""
    texts = iter(["2 + 2 = 4.\n\nThe answer is 4", "I think 5.\n\nThe answer is 5",
                  "no answer", "16 - 3 = 13. The answer is $13.",
                  "She has 16 - 3 = 13 eggs left.\n#### 13\nThe answer is: 13"])
    monkeypatch.setattr(G, "generate", lambda lm, prompts, **kw: [
        [G.Completion(next(texts), 7, True) for _ in range(kw["num_samples"])] for _ in prompts])
    out = G.sample_chains(lm, ROWS, k=2, style="gsm8k")
    assert [(r["cot"], r["prediction"], r["answer_line"], r["correct"]) for r in out] == [
        ("2 + 2 = 4.", "4", True, True), ("I think 5.", "5", True, False),
        ("no answer", None, False, False), ("16 - 3 = 13.", "$13.", True, True)]
    # a model that does not write the answer line yet: its last number, its closing
    # answer statements left out of the chain
    out = G.sample_chains(lm, ROWS[1:], k=1, style="gsm8k")
    assert [(r["cot"], r["prediction"], r["answer_line"], r["correct"]) for r in out] == [
        ("She has 16 - 3 = 13 eggs left.", "13", False, True)]


def test_read_answer_without_an_answer_line():
    assert G.read_answer("So x = \\boxed{\\frac{1}{2}}.\nFinal answer: 1/2", "math") == (
        "So x = \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", False)
    assert G.read_answer("It costs 1,250 dollars.", "gsm8k") == ("It costs 1,250 dollars.", "1,250", False)
    assert G.read_answer("no boxed 3", "math") == ("no boxed 3", None, False)
    assert G.read_answer("#### 5", "gsm8k") == ("#### 5", "5", False)  # never an empty chain


def test_solve_counts_the_chain_before_the_answer(lm, monkeypatch):
    seen = []

    def fake(lm_, prompts, **kw):
        seen.extend(prompts)
        return [[G.Completion("2 + 2 = 4.\n\nThe answer is 4", 12, True)],
                [G.Completion("sixteen minus three", 30, False)]]

    monkeypatch.setattr(G, "generate", fake)
    out = G.solve(lm, ROWS, budget=0.5, style="gsm8k")
    assert all(directive(0.5) in p for p in seen)
    assert out[0]["correct"] and out[0]["chain_tokens"] == len(
        lm.tokenizer("2 + 2 = 4.", add_special_tokens=False)["input_ids"])
    assert not out[1]["correct"] and out[1]["prediction"] is None
    assert out[1]["chain_tokens"] == 30 and not out[1]["finished"]  # no answer: every token
    monkeypatch.undo()
    real = G.solve(lm, ROWS, budget=1.0, style="gsm8k", max_new_tokens=6)  # the real decoder
    assert [r["budget"] for r in real] == [1.0, 1.0] and all(r["tokens"] <= 6 for r in real)


def test_summarize():
    solved = []
    for i in range(40):
        solved.append({"id": str(i), "budget": 1.0, "correct": i % 2 == 0, "chain_tokens": 100,
                       "finished": True})
        solved.append({"id": str(i), "budget": 0.5, "correct": i % 4 == 0,
                       "chain_tokens": 40 + (i % 3) * 10, "finished": i != 3})
    solved.append({"id": "extra", "budget": 0.5, "correct": True, "chain_tokens": 5, "finished": True})
    half, full = G.summarize(solved, n_boot=500)
    assert full["budget"] == 1.0 and full["n"] == 40 and full["accuracy"] == 0.5
    assert full["compression"] == 1.0 and full["chain_tokens"] == 100
    assert half["n"] == 41 and half["paired_n"] == 40  # "extra" has no γ=1 answer to pair
    expected = np.mean([40 + (i % 3) * 10 for i in range(40)]) / 100
    assert half["compression"] == pytest.approx(expected)
    lo, hi = half["compression_ci"]
    assert lo < expected < hi and hi - lo < 0.1
    lo, hi = half["accuracy_ci"]
    assert lo < half["accuracy"] < hi
    assert half["finished"] == pytest.approx(40 / 41)
    assert G.summarize([r for r in solved if r["budget"] == 0.5])[0]["compression"] is None
    table = G.summary_table([half, full])
    assert "0.5" in table and "n/a" not in table


# ---------------------------------------------------------------- fine-tuning


def demo_records(n: int = 6, fmt=sft_prompt_completion) -> list[dict]:
    from mist_core.data.demo import demo_corpus

    budgets = (1.0, 0.5)
    return [fmt(id=r["id"], question=r["question"], cot=r["cot"], answer=str(r["answer"]),
                budget=budgets[i % 2]) for i, r in enumerate(demo_corpus(n, seed=3))]


def plain_tokenizer(tokenizer):
    """The test tokenizer without its chat template."""
    return tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", bos_token="<|im_start|>")


@pytest.mark.parametrize("chat", [True, False])
def test_training_examples_start_with_the_decoding_prompt(tokenizer, tmp_path, chat):
    """What TRL trains on begins with exactly the tokens generation.prompt_text gives at
    decoding time, and the loss covers everything after them."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from mist_core.distill.finetune import training_record

    tok = tokenizer if chat else plain_tokenizer(tokenizer)
    records = demo_records(4) + demo_records(2, sft_messages)
    trainer = SFTTrainer(
        model=make_model("llama", len(tok)), processing_class=tok,
        train_dataset=Dataset.from_list([training_record(r, tok) for r in records]),
        args=SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                       completion_only_loss=True, max_length=256))
    lm = wrap_model(make_model("llama", len(tok)), tok)
    for rec, ex in zip(records, trainer.train_dataset):
        user = (rec.get("prompt") or rec["messages"])[0]["content"]
        q, _, d = user.partition("\n\n")
        prompt = G.encode_prompt(tok, G.prompt_text(lm, q, 0.5 if d else 1.0))
        assert ex["input_ids"][:len(prompt)] == prompt
        ids = ex["input_ids"]
        assert ex["labels"] == [-100] * len(prompt) + ids[len(prompt):]  # loss on the completion
        assert tok.eos_token_id in ids[len(prompt):]  # which ends: the model learns to stop


def test_read_sft_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mist_core.distill.finetune import read_sft

    recs = demo_records(4)
    (tmp_path / "out" / "sft").mkdir(parents=True)
    (tmp_path / "out" / "sft" / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:2]))
    (tmp_path / "out" / "sft" / "_tmp-part-1.jsonl").write_text("not json\n")  # a write in progress
    pq.write_table(pa.Table.from_pylist(recs[2:]), tmp_path / "out" / "sft" / "part-1.parquet")
    assert read_sft(tmp_path / "out") == recs == read_sft(tmp_path / "out" / "sft")
    assert read_sft(tmp_path / "out" / "sft" / "part-0.jsonl") == recs[:2]
    with pytest.raises(FileNotFoundError):
        read_sft(tmp_path / "missing")


def test_finetune_in_memory_lowers_the_loss_and_saves_a_loadable_model(tokenizer, tmp_path):
    from mist_core import load_model
    from mist_core.distill.finetune import completion_loss, finetune

    records = demo_records(6)
    lm = wrap_model(make_model("llama", len(tokenizer), seed=1), tokenizer, "fresh")
    before = completion_loss(lm.model, tokenizer, records)
    out = finetune(lm, records, tmp_path / "ft", epochs=6, learning_rate=3e-3, batch_size=3,
                   log_every=1, gradient_checkpointing=False)
    after = completion_loss(lm.model, tokenizer, records)
    assert after < 0.85 * before, (before, after)
    # the handle stays a frozen decoding handle, and the folder holds the same model
    assert not lm.model.training and not any(p.requires_grad for p in lm.model.parameters())
    assert (out / "model.safetensors").is_file()
    loaded = load_model(str(out))
    assert completion_loss(loaded.model, loaded.tokenizer, records) == pytest.approx(after, rel=1e-4)
    assert G.prompt_text(loaded, "q") == G.prompt_text(lm, "q")  # the chat template travels
    report = json.loads((out / "training.json").read_text())
    assert report["records"] == 6 and report["steps"] == 12 and len(report["losses"]) >= 12
    assert report["losses"][-1]["loss"] < report["losses"][0]["loss"]
    assert report["settings"]["gradient_checkpointing"] is False  # TRL's default is on


def test_finetune_lora_from_a_folder_merges_the_adapters(model_dir, tmp_path):
    from mist_core import load_model
    from mist_core.distill.finetune import completion_loss, finetune

    records = demo_records(6, sft_messages)
    base = load_model(str(model_dir))
    before = completion_loss(base.model, base.tokenizer, records)
    out = finetune(str(model_dir), records, tmp_path / "lora", lora=True, lora_rank=8,
                   epochs=5, learning_rate=2e-2, batch_size=3)
    assert not (out / "adapter_config.json").exists()  # a plain model, adapters merged
    tuned = load_model(str(out))
    assert {n for n, _ in tuned.model.named_parameters()} == {n for n, _ in base.model.named_parameters()}
    after = completion_loss(tuned.model, tuned.tokenizer, records)
    assert after < 0.9 * before, (before, after)
    # LoRA leaves what it does not adapt alone: embeddings, norms and the unembedding
    for name, p in base.model.named_parameters():
        q = dict(tuned.model.named_parameters())[name]
        frozen = "proj" not in name
        assert torch.equal(p, q) == frozen, name
    settings = json.loads((out / "training.json").read_text())["settings"]
    assert settings["lora_rank"] == 8 and settings["gradient_checkpointing"] is True  # TRL's


def test_finetune_without_a_chat_template(tokenizer, tmp_path):
    from mist_core.distill.finetune import completion_loss, finetune

    tok = plain_tokenizer(tokenizer)
    lm = wrap_model(make_model("llama", len(tok), seed=2), tok, "plain")
    records = demo_records(4)
    before = completion_loss(lm.model, tok, records)
    finetune(lm, records, tmp_path / "plain", epochs=5, learning_rate=3e-3, batch_size=2)
    assert completion_loss(lm.model, tok, records) < 0.85 * before


# ---------------------------------------------------------------- the commands, end to end
# A tiny model that has learnt four short chains stands in for a real one: sampling from it
# gives right and wrong answers, so `mist generate` has something to keep and to reject.

QUESTIONS = [("q1", "What is 3 + 4?", "3 + 4 = 7.", "7"),
             ("q2", "What is 9 - 5?", "9 - 5 = 4.", "4"),
             ("q3", "What is 2 * 6?", "2 * 6 = 12.", "12"),
             ("q4", "What is 8 / 2?", "8 / 2 = 4.", "4")]


@pytest.fixture(scope="module")
def teacher(tokenizer, tmp_path_factory):
    from mist_core.distill.finetune import finetune

    records = [sft_prompt_completion(id=i, question=q, cot=c, answer=a, budget=1.0)
               for i, q, c, a in QUESTIONS]
    lm = wrap_model(make_model("llama", len(tokenizer), seed=3), tokenizer, "teacher")
    return finetune(lm, records * 4, tmp_path_factory.mktemp("teacher") / "model", epochs=10,
                    learning_rate=1e-2, batch_size=4)


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("questions") / "questions.jsonl"
    rows = [{"id": i, "question": q, "answer": a} for i, q, _, a in QUESTIONS]
    rows.append({"id": "bad", "question": "What is 1 + 1?"})  # no answer: skipped
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mist(*argv) -> int:
    from pipelines.cli import main

    return main([str(a) for a in argv])


@pytest.mark.integration
def test_generate_compress_train_solve(local_ray, teacher, questions, tmp_path, capsys):
    from mist_core import load_model
    from mist_core.measures.answers import answer_correct

    gen, comp = tmp_path / "gen", tmp_path / "comp"
    assert mist("generate", "--input", questions, "--model", teacher, "--k", 3,
                "--temperature", 1.0, "--max-new-tokens", 24, "--output", gen,
                "--batch-size", 4) == 0
    manifest = json.loads((gen / "_manifest.json").read_text())
    c = manifest["counts"]
    assert c["rows_read"] == 5 and c["questions"] == 4 and c["skipped_by_reason"] == {"missing_column": 1}
    assert c["samples"] == 12 and c["kept"] + c["rejected"] == 12
    assert c["kept"] >= 2 and sum(c["rejected_by_reason"].values()) == c["rejected"]
    chains = [json.loads(x) for x in (gen / "chains.jsonl").read_text().splitlines()]
    rejected = [json.loads(x) for x in (gen / "_rejected.jsonl").read_text().splitlines()]
    assert len(chains) == c["kept"] and len(rejected) == c["rejected"]
    gold = {i: a for i, _, _, a in QUESTIONS}
    for row in chains:
        assert set(row) == {"id", "question", "cot", "answer", "source_id"}
        assert row["answer"] == gold[row["source_id"]] and row["id"].startswith(row["source_id"] + "#")
    for r in rejected:
        if r["reason"] == "wrong_answer":
            assert not answer_correct(r["prediction"], gold[r["source_id"]], "gsm8k")

    # the corpus is the compression job's input as is
    assert mist("compress", "--input", gen, "--adapter", "generic", "--model", teacher,
                "--budgets", "0.5", "--output", comp, "--batch-size", 8) == 0
    job = json.loads((comp / "_manifest.json").read_text())
    assert job["counts"]["scored"] == c["kept"] and job["counts"]["rejected"] == 0

    student = tmp_path / "student"
    assert mist("train", "--sft", comp, "--model", teacher, "--output", student,
                "--epochs", 2, "--lr", 1e-3, "--batch-size", 2, "--log-every", 1) == 0
    report = json.loads((student / "training.json").read_text())
    # a record at γ 0.5 and one whole for each chain (sft_mix "all")
    assert report["records"] == 2 * c["kept"] and report["workers"] == 1 and report["steps"] >= 2
    load_model(str(student))

    solved = tmp_path / "solve"
    capsys.readouterr()
    assert mist("solve", "--input", questions, "--model", student, "--budgets", "0.5,1.0",
                "--max-new-tokens", 16, "--output", solved, "--n-boot", 200) == 0
    printed = capsys.readouterr().out
    results = [json.loads(x) for x in (solved / "results.jsonl").read_text().splitlines()]
    assert sorted((r["budget"], r["id"]) for r in results) == [
        (b, i) for b in (0.5, 1.0) for i in sorted(gold)]
    summary = json.loads((solved / "summary.json").read_text())["summary"]
    assert [s["budget"] for s in summary] == [0.5, 1.0] and all(s["n"] == 4 for s in summary)
    for s in summary:
        mine = [r for r in results if r["budget"] == s["budget"]]
        assert s["accuracy"] == pytest.approx(np.mean([r["correct"] for r in mine]))
    assert "accuracy" in printed and "compression" in printed


@pytest.mark.integration
def test_train_on_two_ray_train_workers(local_ray, teacher, tmp_path):
    """--workers 2: the same fine-tuning under Ray Train's TorchTrainer on CPU (gloo), each
    worker on its shard; rank 0's model is the checkpoint copied to --output."""
    from mist_core import load_model
    from mist_core.distill.finetune import completion_loss

    sft = tmp_path / "sft.jsonl"
    records = [sft_prompt_completion(id=i, question=q, cot=c, answer=a, budget=b)
               for i, q, c, a in QUESTIONS for b in (1.0, 0.5)]
    sft.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "ddp"
    assert mist("train", "--sft", sft, "--model", teacher, "--output", out, "--workers", 2,
                "--epochs", 2, "--lr", 1e-3, "--batch-size", 2, "--log-every", 1) == 0
    report = json.loads((out / "training.json").read_text())
    # 8 records, 2 per worker per step, 2 workers: 2 steps an epoch
    assert report["world_size"] == 2 and report["workers"] == 2 and report["steps"] == 4
    before, after = load_model(str(teacher)), load_model(str(out))
    assert completion_loss(after.model, after.tokenizer, records) < \
        completion_loss(before.model, before.tokenizer, records)


def _sample(q, i, cot, tokens, correct=True, finished=True):
    return {"id": f"{q}#{i}", "source_id": q, "sample": i, "question": "?", "cot": cot,
            "answer": "4", "prediction": "4" if correct else "5", "answer_line": True,
            "correct": correct, "tokens": tokens, "finished": finished}


def test_select_keeps_each_questions_shortest_right_chain_and_accounts_for_the_rest():
    from pipelines.loop.generate import CORPUS_COLUMNS, parse_args, select

    samples = [_sample("a", 0, "two plus two is four", 9), _sample("a", 1, "2 + 2 = 4", 5),
               _sample("a", 2, "2+2=4", 3, correct=False),  # shorter, but wrong
               _sample("a", 3, "2 + 2 = 4", 5),  # the same chain again
               _sample("b", 0, "x = 4", 4), _sample("b", 1, "y = 4", 4),  # equals: the first
               _sample("c", 0, "no", 2, correct=False)]
    kept, rejected = select(samples, "shortest")
    assert [r["id"] for r in kept] == ["a#1", "b#0"]
    assert all(set(r) == set(CORPUS_COLUMNS) for r in kept)
    assert [(r["id"], r["reason"]) for r in rejected] == [
        ("a#0", "not_shortest"), ("a#2", "wrong_answer"), ("a#3", "duplicate_chain"),
        ("b#1", "not_shortest"), ("c#0", "wrong_answer")]
    every, rest = select(samples, "all")  # every right chain, one of each
    assert [r["id"] for r in every] == ["a#0", "a#1", "b#0", "b#1"]
    assert len(every) + len(rest) == len(kept) + len(rejected) == len(samples)
    assert {r["id"] for r in rest} == {"a#2", "a#3", "c#0"}
    assert parse_args(["--input", "q", "--output", "o"], "g").keep == "shortest"
    assert parse_args(["--input", "q", "--output", "o", "--keep", "all"], "g").keep == "all"


def test_bad_settings_exit_2(tmp_path, capsys, questions):
    assert mist("generate", "--input", questions, "--model", tmp_path / "nope", "--output",
                tmp_path / "g") == 2
    assert "error:" in capsys.readouterr().err
    assert mist("train", "--sft", tmp_path / "missing", "--output", tmp_path / "t") == 2
    assert "no SFT records" in capsys.readouterr().err
    assert mist("solve", "--input", questions, "--budgets", "0,1", "--output", tmp_path / "s") == 2
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert mist("train", "--sft", tmp_path, "--output", tmp_path / "busy") == 2
    assert "not a model" in capsys.readouterr().err


# ---------------------------------------------------------------- the vLLM engine's glue
# vLLM is not installed here (no GPU): what is checked is everything around the engine: the
# choice, the requests (the same prompt tokens and per-sample seeds as transformers), the
# judging of its output, and that Ray Data's processor accepts the configuration.


def test_engine_choice(monkeypatch):
    import importlib.util

    from mist_core.errors import MissingDependency
    from pipelines.loop import generate
    from pipelines.common.errors import ConfigError

    real = importlib.util.find_spec
    for installed in (False, True):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if installed else None) if name == "vllm"
                            else real(name, *a))
        assert generate.choose_engine("auto", 0) == "transformers"
        assert generate.choose_engine("auto", 1) == ("vllm" if installed else "transformers")
        assert generate.choose_engine("transformers", 1) == "transformers"
        with pytest.raises(ConfigError if installed else MissingDependency):
            generate.choose_engine("vllm", 0)


def test_vllm_requests_and_samples(lm):
    from pipelines.loop import generate

    reqs = generate.vllm_requests(ROWS, lm.tokenizer, k=2, seed=5)
    assert [(r["id"], r["sample"]) for r in reqs] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    for r in reqs:
        assert r["prompt"] == G.prompt_text(lm, r["question"])
        assert r["tokenized_prompt"] == G.encode_prompt(lm.tokenizer, r["prompt"])
    assert len({r["seed"] for r in reqs}) == 4 and all(0 <= r["seed"] < 2**31 for r in reqs)
    req = generate.vllm_request(reqs[1], temperature=0.7, top_p=0.9, max_new_tokens=64)
    assert req["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64,
                                      "seed": reqs[1]["seed"]}
    out = {**reqs[1], **req, "generated_text": "2 + 2 = 4.\n\nThe answer is 4",
           "num_generated_tokens": 12}
    s = generate.vllm_sample(out, style="gsm8k", max_new_tokens=64)
    assert s == {"id": "a#1", "source_id": "a", "sample": 1, "question": ROWS[0]["question"],
                 "cot": "2 + 2 = 4.", "answer": "4", "prediction": "4", "answer_line": True,
                 "correct": True, "tokens": 12, "finished": True}
    assert set(s) == set(generate.SAMPLE_SCHEMA.names)
    cut = generate.vllm_sample({**out, "num_generated_tokens": 64}, style="gsm8k", max_new_tokens=64)
    assert not cut["finished"] and generate.verdict(cut, set()) == "unfinished"


@pytest.mark.integration
def test_vllm_processor_accepts_the_configuration(local_ray, teacher):
    import argparse

    import ray

    from pipelines.loop import generate

    args = argparse.Namespace(model=str(teacher), k=2, seed=0, dtype="float32", actors=(1, 1),
                              batch_size=4, temperature=0.7, top_p=0.95, max_new_tokens=16)
    ds = generate.vllm_samples(ROWS, args, "gsm8k")  # lazy: nothing runs without vLLM
    assert isinstance(ds, ray.data.Dataset)
