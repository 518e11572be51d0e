"""The job's outputs as the tools users train and query with read them, as written: polars,
duckdb, pyarrow and `datasets` glob reads of every parquet folder after a refresh run that
adds columns; TRL's SFTTrainer on sft/ with the loss on the completion only; LLaMA-Factory's
dataset_info.json entry; rejects that keep their ids and say why."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mist_core.data.demo import demo_corpus
from mist_core.data.formats import (DATA_COLUMNS, REJECT_SCHEMA, directive, llamafactory_entry,
                                    sft_records)
from pipelines.job import compress
from pipelines.job.config import JobConfig
from pipelines.common.settings import validate
from pipelines.common.sources import RAW_SCHEMA
from pipelines.job.stages import REJECT, prepare_batch

BUDGETS = [0.5, 0.8]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_job(corpus: Path, out: Path, model_dir, **kw) -> dict:
    return compress.run(validate(JobConfig(input=[str(corpus)], output=str(out),
                                           model=str(model_dir), budgets=BUDGETS, batch_size=8,
                                           **kw)))


FIRST = [dict(r, id=f"a{i}") for i, r in enumerate(demo_corpus(4, seed=21))]
# The refresh brings a column the first run did not have (`level`), lacks one it had
# (`topic`), and one row that is rejected.
SECOND = [{k: v for k, v in dict(r, id=f"b{i}", level=i + 1).items() if k != "topic"}
          for i, r in enumerate(demo_corpus(3, seed=22))]


@pytest.fixture(scope="module")
def refreshed(local_ray, model_dir, tmp_path_factory):
    """Two runs onto one output, the second adding rows with a new column. What the first
    run left in rejects/ (no row was rejected) is checked before the second runs."""
    import duckdb

    base = tmp_path_factory.mktemp("refresh")
    out = base / "out"
    corpus = write_jsonl(base / "corpus.jsonl", FIRST)
    first = run_job(corpus, out, model_dir, scores=True)
    no_rejects = duckdb.sql(f"SELECT count(*) AS n FROM '{out}/rejects/*.parquet'").fetchall()
    no_rejects_columns = duckdb.sql(f"SELECT * FROM '{out}/rejects/*.parquet'").columns
    write_jsonl(corpus, FIRST + SECOND + [{"id": "bad", "question": "q", "cot": "", "answer": "1"}])
    second = run_job(corpus, out, model_dir, scores=True)
    return {"out": out, "first": first, "second": second, "no_rejects": no_rejects,
            "no_rejects_columns": no_rejects_columns}


N_DATA = (len(FIRST) + len(SECOND)) * len(BUDGETS)


@pytest.mark.integration
def test_refresh_rewrites_earlier_files_to_one_schema(refreshed):
    out = refreshed["out"]
    first, second = refreshed["first"], refreshed["second"]
    assert first["counts"]["rejected"] == 0 and second["counts"]["rejected"] == 1
    assert second["counts"]["scored"] == len(SECOND) and second["counts"]["already_done"] == 4
    files = sorted((out / "data").glob("*.parquet"))
    earlier = [f for f in files if f.name.startswith(first["run_id"])]
    assert second["counts"]["data_files_conformed"] == len(earlier) >= 1
    schemas = {pq.read_schema(f).remove_metadata() for f in files}
    assert len(schemas) == 1
    [schema] = schemas
    assert schema.names == list(DATA_COLUMNS) + ["topic", "level"]
    assert [f["name"] for f in second["data_schema"]] == schema.names
    assert second["totals"]["rows_per_budget"] == {"0.5": 7, "0.8": 7}


@pytest.mark.integration
def test_polars_reads_every_row_and_column(refreshed):
    import polars as pl

    df = pl.read_parquet(f"{refreshed['out']}/data/*.parquet")
    assert df.height == N_DATA
    by_id = {r["id"]: r for r in df.iter_rows(named=True)}
    assert by_id["a0"]["level"] is None and by_id["a0"]["topic"] == FIRST[0]["topic"]
    assert by_id["b2"]["level"] == 3 and by_id["b2"]["topic"] is None
    scores = pl.read_parquet(f"{refreshed['out']}/scores/*.parquet")
    assert scores.height == len(FIRST) + len(SECOND)
    rejects = pl.read_parquet(f"{refreshed['out']}/rejects/*.parquet")
    assert rejects["id"].to_list() == ["bad"]


@pytest.mark.integration
def test_duckdb_reads_every_row_and_column(refreshed):
    import duckdb

    out = refreshed["out"]
    [(n, levels)] = duckdb.sql(
        f"SELECT count(*), count(level) FROM '{out}/data/*.parquet'").fetchall()
    assert (n, levels) == (N_DATA, len(SECOND) * len(BUDGETS))
    assert duckdb.sql(f"SELECT reason, detail FROM '{out}/rejects/*.parquet'").fetchall() == \
        [("empty_cot", "cot is empty or only whitespace")]
    # With no rejected row, rejects/ already held a file of its schema.
    assert refreshed["no_rejects"] == [(0,)]
    assert refreshed["no_rejects_columns"] == REJECT_SCHEMA.names


@pytest.mark.integration
def test_datasets_and_pyarrow_read_every_row_and_column(refreshed, tmp_path):
    import datasets
    import pyarrow.dataset as pads

    out = refreshed["out"]
    ds = datasets.load_dataset("parquet", data_files=f"{out}/data/*.parquet", split="train",
                               cache_dir=str(tmp_path))
    assert ds.num_rows == N_DATA and {"topic", "level"} <= set(ds.column_names)
    assert sorted(x for x in ds["level"] if x is not None) == [1, 1, 2, 2, 3, 3]
    table = pads.dataset(out / "data", format="parquet").to_table()
    assert table.num_rows == N_DATA and table.schema.names[-2:] == ["topic", "level"]
    assert pq.read_table(out / "rejects").num_rows == 1


def test_scores_files_of_an_older_version_are_conformed(tmp_path):
    """An output's scores/ file written before `facts_necessity` gets that column (null) when
    a run with --scores refreshes it, so that a glob read sees one schema; its rows stay."""
    from mist_core.data.formats import SCORES_SCHEMA
    from pipelines.job.output import Output

    older = pa.schema([f for f in SCORES_SCHEMA if f.name != "facts_necessity"])
    row = {"id": "a", "method": "mist", "model": "m", "token_ids": [1, 2], "tokens": ["x", "y"],
           "necessity": [0.1, 0.2], "sufficiency": [0.3, 0.4], "scores": [1.0, -1.0]}
    (tmp_path / "scores").mkdir()
    pq.write_table(pa.Table.from_pylist([row], schema=older), tmp_path / "scores" / "r0.parquet")
    out = Output(str(tmp_path))
    assert out.conform(SCORES_SCHEMA, "scores") == 1
    table = pq.read_table(tmp_path / "scores" / "r0.parquet")
    assert table.schema.equals(SCORES_SCHEMA, check_metadata=False)
    assert table.to_pylist() == [{**row, "facts_necessity": None}]
    assert out.conform(SCORES_SCHEMA, "scores") == 0


@pytest.mark.integration
def test_manifest_measures_the_kept_share_in_tokens_and_words(refreshed):
    import polars as pl

    totals = refreshed["second"]["totals"]
    assert set(totals["mean_kept_ratio"]) == set(totals["mean_kept_word_ratio"]) == {"0.5", "0.8"}
    df = pl.read_parquet(f"{refreshed['out']}/data/*.parquet")
    for b in BUDGETS:
        rows = df.filter(pl.col("budget") == b)
        words = (rows["kept_words"] / rows["cot_words"]).mean()
        assert totals["mean_kept_word_ratio"][str(b)] == pytest.approx(words, abs=1e-4)
        # Word pruning keeps whole words within the token budget ⌈γ·T⌉.
        assert (rows["kept_tokens"] <= (rows["cot_tokens"] * b).ceil()).all()
    assert all(r["kept_words"] == len(r["compressed_cot"].split()) and r["cot_words"] ==
               len(r["cot"].split()) for r in df.iter_rows(named=True))


# ------------------------------------------------------------------ SFT: TRL, LLaMA-Factory

# The conftest ChatML template with TRL's {% generation %} markers around the assistant's
# output (its end-of-turn token included): what TRL's assistant_only_loss needs.
CHATML_TRAINING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sft_dataset(out: Path, tmp_path):
    import datasets

    return datasets.load_dataset("json", data_files=f"{out}/sft/*.jsonl", split="train",
                                 cache_dir=str(tmp_path / "hf"))


def train_two_steps(model, tokenizer, dataset, tmp_path, **config):
    """SFTTrainer as a user runs it on sft/, two steps; returns the trainer and one collated
    batch."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_steps=2, per_device_train_batch_size=4,
                     learning_rate=1e-3, max_length=256, logging_steps=1, save_strategy="no",
                     report_to="none", use_cpu=True, dataloader_num_workers=0, **config)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert result.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)
    changed = [n for n, p in trainer.model.named_parameters()
               if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before)  # every parameter trained, none frozen
    return batch


def check_loss_on_completion_only(batch, tokenizer, records, prompt_of, completion_of):
    """Every row of the batch: the tokens with a label are exactly the assistant turn as the
    chat template renders it (content, end-of-turn), and the rest is the prompt."""
    rendered = {}
    for rec in records:
        prompt = tokenizer.apply_chat_template(prompt_of(rec), tokenize=False,
                                               add_generation_prompt=True)
        rendered[completion_of(rec) + "<|im_end|>\n"] = prompt
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
        ids, labels = ids[mask.bool()].tolist(), labels[mask.bool()].tolist()
        first = next(i for i, x in enumerate(labels) if x != -100)
        assert all(x == -100 for x in labels[:first])
        assert labels[first:] == ids[first:]  # no hole in the completion either
        completion = tokenizer.decode(ids[first:])
        assert completion in rendered, completion
        assert tokenizer.decode(ids[:first]) == rendered[completion]


def read_sft(out: Path) -> list[dict]:
    return [json.loads(x) for p in sorted((out / "sft").glob("*.jsonl"))
            for x in p.read_text().splitlines()]


@pytest.mark.integration
def test_trl_trains_on_prompt_completion_with_the_loss_on_the_completion(refreshed, model_dir,
                                                                         tmp_path):
    from transformers import AutoTokenizer

    from mist_core import load_model

    out = refreshed["out"]
    assert not (out / "dataset_info.json").exists()  # LLaMA-Factory does not read this layout
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = read_sft(out)
    assert len(records) == (len(FIRST) + len(SECOND)) * (len(BUDGETS) + 1)  # sft_mix "all"
    batch = train_two_steps(load_model(str(model_dir), for_training=True).model, tokenizer,
                            sft_dataset(out, tmp_path), tmp_path)
    check_loss_on_completion_only(batch, tokenizer, records, lambda r: r["prompt"],
                                  lambda r: r["completion"][0]["content"])


@pytest.fixture(scope="module")
def formats(local_ray, model_dir, tmp_path_factory):
    """The same three rows written as messages and as alpaca records, every γ."""
    base = tmp_path_factory.mktemp("formats")
    corpus = write_jsonl(base / "corpus.jsonl", FIRST[:3])
    outs = {}
    for fmt in ("messages", "alpaca"):
        outs[fmt] = base / fmt
        run_job(corpus, outs[fmt], model_dir, sft_format=fmt, sft_mix="all")
    return outs


@pytest.mark.integration
def test_trl_trains_on_messages_with_the_loss_on_the_assistant_turn(formats, model_dir, tmp_path):
    """The messages layout is TRL's conversational language modeling: assistant_only_loss
    puts the loss on the assistant turn, given a chat template with generation markers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHATML_TRAINING
    records = read_sft(formats["messages"])
    assert len(records) == 3 * 3 and all(r["messages"][0]["role"] == "user" for r in records)
    batch = train_two_steps(str(model_dir), tokenizer, sft_dataset(formats["messages"], tmp_path),
                            tmp_path, assistant_only_loss=True)
    check_loss_on_completion_only(batch, tokenizer, records, lambda r: r["messages"][:1],
                                  lambda r: r["messages"][1]["content"])


def llamafactory_load(dataset_dir: Path, name: str, tmp_path) -> list[dict]:
    """LLaMA-Factory's reading of a dataset_info.json entry (data/parser.py, loader.py and
    converter.py): the files under file_name, loaded by their common type, then the
    declared columns (and, for sharegpt, tags) mapped to user and assistant turns."""
    import datasets

    entry = json.loads((dataset_dir / "dataset_info.json").read_text())[name]
    local = dataset_dir / entry["file_name"]
    files = sorted(local.iterdir()) if local.is_dir() else [local]
    assert {f.suffix for f in files} == {".jsonl"}  # "File types should be identical."
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train",
                               cache_dir=str(tmp_path / "hf"))
    columns, turns = entry.get("columns", {}), []
    for ex in ds:
        if entry.get("formatting", "alpaca") == "alpaca":
            query = [ex[columns.get(k, d)] for k, d in (("prompt", "instruction"),
                                                        ("query", "input"))]
            turns.append({"user": "\n".join(q for q in query if q),
                          "assistant": ex[columns.get("response", "output")]})
        else:
            tags = entry["tags"]
            messages = ex[columns["messages"]]
            roles = [m[tags["role_tag"]] for m in messages]
            assert roles == [tags["user_tag"], tags["assistant_tag"]]
            turns.append({"user": messages[0][tags["content_tag"]],
                          "assistant": messages[1][tags["content_tag"]]})
    return turns


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["alpaca", "messages"])
def test_llamafactory_entry_reads_the_records(formats, fmt, tmp_path):
    out = formats[fmt]
    info = json.loads((out / "dataset_info.json").read_text())
    assert info == {"mist": llamafactory_entry(fmt)}
    turns = llamafactory_load(out, "mist", tmp_path)
    expected = [r["question"] + ("" if directive(b) is None else f"\n\n{directive(b)}")
                for r in FIRST[:3] for b in BUDGETS + [1.0]]
    assert sorted(t["user"] for t in turns) == sorted(expected)
    assert all(t["assistant"].endswith("\n\nThe answer is " + next(
        r["answer"] for r in FIRST if t["user"].startswith(r["question"]))) for t in turns)


# ------------------------------------------------------------------ formats, rejects


def test_sft_record_layouts():
    args = dict(id="x", question="Q?", cot="full chain", answer="4", compressed={0.5: "half"},
                mix="all")
    pc, full = sft_records(fmt="prompt-completion", **args)
    assert pc == {"id": "x", "budget": 0.5,
                  "prompt": [{"role": "user",
                              "content": "Q?\n\nPlease reduce 50% of the tokens in your CoT."}],
                  "completion": [{"role": "assistant", "content": "half\n\nThe answer is 4"}]}
    assert full["prompt"][0]["content"] == "Q?"  # no directive for the full chain
    msg = sft_records(fmt="messages", **args)[0]
    assert msg["messages"] == pc["prompt"] + pc["completion"]
    assert sft_records(fmt="chat", **args) == sft_records(fmt="messages", **args)
    alpaca = sft_records(fmt="alpaca", **args)[0]
    assert (alpaca["instruction"], alpaca["input"], alpaca["output"]) == (
        pc["prompt"][0]["content"], "", pc["completion"][0]["content"])
    assert llamafactory_entry("tokenskip") == llamafactory_entry("alpaca")
    assert llamafactory_entry("prompt-completion") is None
    with pytest.raises(ValueError):
        sft_records(fmt="sharegpt", **args)


def raw_batch(lines: list[bytes]) -> pa.Table:
    n = len(lines)
    return pa.table({"input": [0] * n, "source": ["c.jsonl"] * n, "row": list(range(1, n + 1)),
                     "raw": lines, "error": [None] * n}, schema=RAW_SCHEMA)


@pytest.mark.parametrize("adapter, columns, row, reason, want_id", [
    ("generic", {}, {"id": "r1", "question": "q", "answer": "1"}, "missing_column", "r1"),
    ("generic", {}, {"id": "r2", "question": "q", "cot": " ", "answer": "1"}, "empty_cot", "r2"),
    ("generic", {}, {"id": 7, "question": "q", "cot": ["a"], "answer": "1"}, "cot_not_string", "7"),
    ("generic", {}, {"id": "r4", "question": "q\u0000", "cot": "c", "answer": "1"},
     "null_byte_in_question", "r4"),
    ("generic", {"id": "uid", "cot": "why"}, {"uid": "r5", "question": "q", "answer": "1"},
     "missing_column", "r5"),
    ("gsm8k", {}, {"id": "r6", "question": "q", "answer": "no marker"}, "no_final_answer", "r6"),
    ("generic", {}, {"id": True, "question": "q", "cot": "c", "answer": "1"}, "id_not_string",
     None),
    ("generic", {}, {"id": " ", "question": "q", "cot": "c", "answer": "1"}, "empty_id", None),
    ("generic", {}, [1, 2], "not_an_object", None),
])
def test_rejects_keep_the_id_and_say_why(model_dir, adapter, columns, row, reason, want_id):
    cfg = JobConfig(adapter=adapter, columns=columns, model=str(model_dir))
    [rej] = prepare_batch(raw_batch([json.dumps(row).encode()]), cfg=cfg, done_ids=frozenset(),
                          dup_rows=frozenset()).to_pylist()
    assert (rej["status"], rej["reason"], rej["id"]) == (REJECT, reason, want_id)
    assert rej["detail"].strip() and rej["raw"]
