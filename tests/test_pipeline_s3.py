"""End to end: the compression job on a local Ray (2 CPUs, loopback), reading a corpus with
malformed rows from a moto S3 server as JSONL and parquet, with a tiny random Llama; then
refresh runs, a resumed unfinished run, overwrite, and a run whose counts cannot reconcile."""
from __future__ import annotations

import io
import json
import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import loopback_ray
from mist_core import Example, get_template, prune
from mist_core.data.demo import demo_corpus
from mist_core.data.formats import DATA_COLUMNS, directive
from mist_core.scoring.choices import ALPHA
from mist_core.scoring.scorer import combine, zscore
from pipelines.job import compress
from pipelines.common import storage
from pipelines.common.settings import ConfigError, validate
from pipelines.job.config import JobConfig
from s3_server import SECRET_KEY, environ_patch, keys, moto_s3, s3_client, s3_env

pytestmark = pytest.mark.integration  # moto_server and the job on a local Ray

BUCKET = "mist-pipeline-test"
BUDGETS = [0.5, 0.8]


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as url, environ_patch(s3_env(url)):
        client = s3_client(url)
        client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture(scope="module")
def local_ray(s3):
    """Started after the S3 variables are set, so that its workers inherit them."""
    with loopback_ray():
        yield


def rows(seed: int, n: int, tag: str) -> list[dict]:
    out = demo_corpus(n, seed=seed)
    for i, r in enumerate(out):
        r["id"] = f"{tag}{i}"
        r["difficulty"] = i % 3 + 1
    return out


def line(row: dict) -> bytes:
    return json.dumps(row).encode()


A = rows(1, 6, "a")  # JSONL
B = rows(2, 4, "b")  # parquet
C = rows(3, 3, "c")  # added for the refresh run


def jsonl(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


PART1 = jsonl([
    line(A[0]),                                                    # 1
    line(A[1]),                                                    # 2
    b'{"question": "broken',                                       # 3 invalid_json
    line(A[2]),                                                    # 4
    b'{"question": "caf\xe9?", "cot": "c", "answer": "1"}',        # 5 invalid_utf8
    b"",                                                           # 6 blank: not a row
    b"[1, 2, 3]",                                                  # 7 not_an_object
    line({"question": "q", "answer": "1"}),                        # 8 missing_column
    line(A[3]),                                                    # 9
    line({"question": "q", "cot": "c", "answer": " "}),            # 10 empty_answer
    line(A[4]),                                                    # 11
    line(A[5]),                                                    # 12
    line(A[1]),                                                    # 13 duplicate_id
])
PART1_REJECTS = {("part-1.jsonl", 3, "invalid_json"), ("part-1.jsonl", 5, "invalid_utf8"),
                 ("part-1.jsonl", 7, "not_an_object"), ("part-1.jsonl", 8, "missing_column"),
                 ("part-1.jsonl", 10, "empty_answer"), ("part-1.jsonl", 13, "duplicate_id")}
LONG = {"id": "long", "question": "How long?", "cot": " ".join(["step"] * 300), "answer": "1",
        "topic": "long", "difficulty": 9}
PART2_ROWS = [B[0], B[1], {**B[2], "id": "null-cot", "cot": None}, B[2], LONG, B[3]]
PART2_REJECTS = {("part-2.parquet", 3, "missing_column"), ("part-2.parquet", 5, "too_long")}
PART3 = jsonl([line(C[0]), line(C[1]), line(C[2]), line(A[0]), b'{"oops": '])


def parquet_bytes(records: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


def s3_config(model_dir, **kw) -> JobConfig:
    return validate(JobConfig(input=[f"s3://{BUCKET}/corpus/"], output=f"s3://{BUCKET}/out",
                              model=str(model_dir), budgets=BUDGETS, unit="token", scores=True,
                              batch_size=4, actors=(1, 1), **kw))


def read_out(sub: str, columns=None) -> pa.Table:
    fs, root, _ = storage.filesystem(f"s3://{BUCKET}/out")
    return storage.read_parquet_dir(fs, storage.join(root, sub), columns)


def read_sft(client) -> list[dict]:
    out = []
    for key in keys(client, BUCKET, "out/sft/"):
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
        out += [json.loads(x) for x in body.splitlines() if x.strip()]
    return out


def manifest_on_s3(client) -> dict:
    return json.loads(client.get_object(Bucket=BUCKET, Key="out/_manifest.json")["Body"].read())


def test_end_to_end_s3_then_refresh(s3, local_ray, model_dir, tokenizer, capfd):
    s3.put_object(Bucket=BUCKET, Key="corpus/part-1.jsonl", Body=PART1)
    s3.put_object(Bucket=BUCKET, Key="corpus/part-2.parquet", Body=parquet_bytes(PART2_ROWS))
    cfg = s3_config(model_dir)

    # ---- first run
    manifest = compress.run(cfg)
    assert manifest == manifest_on_s3(s3)
    good = A + B
    ids = {r["id"] for r in good}
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"], c["already_done"]) == (18, 10, 8, 0)
    assert c["read"] == c["scored"] + c["rejected"]
    assert c["rejected_by_reason"] == {"duplicate_id": 1, "empty_answer": 1, "invalid_json": 1,
                                       "invalid_utf8": 1, "missing_column": 2, "not_an_object": 1,
                                       "too_long": 1}
    assert c["written_per_budget"] == {"0.5": 10, "0.8": 10}
    assert c["sft_records"] == 10 * 3 and c["score_rows"] == 10  # each at 0.5, 0.8 and 1.0

    # data/: schema, one row per (example, budget), exact token counts, pruning reproduced
    data = read_out("data")
    assert data.schema.names == list(DATA_COLUMNS) + ["difficulty", "topic"]
    assert data.schema.field("difficulty").type == pa.int64()
    assert data.schema.field("kept_tokens").type == pa.int64()
    assert Counter(data.column("budget").to_pylist()) == {0.5: 10, 0.8: 10}
    assert set(data.column("id").to_pylist()) == ids
    scores = {r["id"]: r for r in read_out("scores").to_pylist()}
    assert set(scores) == ids
    tmpl = get_template("auto", tokenizer, 256)
    by_id = {r["id"]: r for r in good}
    for row in data.to_pylist():
        src = by_id[row["id"]]
        ex = Example(src["question"], src["cot"], src["answer"], id=src["id"])
        enc = tmpl.encode(ex)
        assert (row["question"], row["cot"], row["answer"]) == (ex.question, ex.cot, ex.answer)
        assert row["cot_tokens"] == enc.chain_len
        assert row["kept_tokens"] == math.ceil(row["budget"] * enc.chain_len - 1e-9)
        assert (row["method"], row["model"]) == ("mist", "tiny-llama")
        assert (row["topic"], row["difficulty"]) == (src["topic"], src["difficulty"])
        s = scores[row["id"]]
        assert s["token_ids"] == enc.source_ids[enc.chain_start:enc.chain_stop].tolist()
        assert len(s["necessity"]) == len(s["sufficiency"]) == len(s["scores"]) == enc.chain_len
        # the default target ("both"): what pruning ranks, from the three columns written
        both = 0.5 * zscore(combine(np.array(s["necessity"]), np.array(s["sufficiency"]), ALPHA)) \
            + 0.5 * zscore(combine(np.array(s["facts_necessity"]), None, ALPHA))
        np.testing.assert_allclose(s["scores"], both, rtol=1e-9, atol=1e-9)
        assert "".join(s["tokens"]) == ex.cot
        again = prune(ex, SimpleNamespace(scores=s["scores"], chain_offsets=enc.chain_offsets),
                      budgets=[row["budget"]], unit="token",
                      facts_first=True, sentences_first="equations")[0]  # the job's defaults
        assert row["compressed_cot"] == again.text and again.kept_tokens == row["kept_tokens"]

    # rejects/: every unusable row, where it was, why, and what it said
    rejects = read_out("rejects").to_pylist()
    assert {(r["source"].rsplit("/", 1)[1], r["row"], r["reason"]) for r in rejects} == \
        PART1_REJECTS | PART2_REJECTS
    assert all(r["source"].startswith(f"s3://{BUCKET}/corpus/") and r["raw"] for r in rejects)
    utf8 = next(r for r in rejects if r["reason"] == "invalid_utf8")
    assert "caf\\xe9" in utf8["raw"] and utf8["detail"]
    assert next(r for r in rejects if r["reason"] == "too_long")["id"] == "long"
    assert next(r for r in rejects if r["reason"] == "duplicate_id")["id"] == "a1"

    # sft/: one record per example and γ, the full chain too (sft_mix "all"), in TRL's
    # conversational prompt-completion layout
    sft = read_sft(s3)
    assert sorted((r["id"], r["budget"]) for r in sft) == sorted(
        (i, g) for i in ids for g in (0.5, 0.8, 1.0))
    for rec in sft:
        user, assistant = rec["prompt"][0]["content"], rec["completion"][0]["content"]
        d = directive(rec["budget"])
        assert user == by_id[rec["id"]]["question"] + ("" if d is None else f"\n\n{d}")
        assert assistant.endswith(f"\n\nThe answer is {by_id[rec['id']]['answer']}")

    # the manifest: settings, versions, counts, timings; no credentials anywhere
    assert manifest["config"]["input"] == [f"s3://{BUCKET}/corpus/"]
    assert manifest["model"]["name"] == "tiny-llama" and manifest["model"]["device"] == "cpu"
    assert {"ray", "torch", "transformers", "pyarrow", "mist-cot"} <= set(manifest["versions"])
    assert manifest["timings"]["run_s"] > 0 and manifest["throughput"]["chains_per_s"] > 0
    assert manifest["totals"]["rows_per_budget"] == {"0.5": 10, "0.8": 10}
    assert manifest["totals"]["rejects"] == 8 and manifest["totals"]["sft_records"] == 30
    assert [f["name"] for f in manifest["data_schema"]][-2:] == ["difficulty", "topic"]
    assert len(manifest["runs"]) == 1
    assert SECRET_KEY not in json.dumps(manifest)

    # ---- refresh: three new rows, one already-done id, one new malformed line
    s3.put_object(Bucket=BUCKET, Key="corpus/part-3.jsonl", Body=PART3)
    manifest = compress.run(cfg)
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["already_done"]) == (23, 3, 12)
    assert c["rejected"] == 8 and c["rejects_already_recorded"] == 7
    assert c["read"] == c["scored"] + c["rejected"] + c["already_done"]
    assert c["written_per_budget"] == {"0.5": 3, "0.8": 3}
    data = read_out("data", ["id", "budget"])
    pairs = list(zip(data.column("id").to_pylist(), data.column("budget").to_pylist()))
    assert len(pairs) == len(set(pairs)) == 26
    assert {i for i, _ in pairs} == ids | {"c0", "c1", "c2"}
    assert len(read_out("rejects")) == 9 and len(read_sft(s3)) == 13 * 3
    assert manifest["totals"]["rows_per_budget"] == {"0.5": 13, "0.8": 13}
    assert len(manifest["runs"]) == 2

    # ---- the same input again: nothing new is written, only the manifest changes
    before = keys(s3, BUCKET, "out/")
    manifest = compress.run(cfg)
    after = keys(s3, BUCKET, "out/")
    assert set(after) == set(before)
    assert {k for k in after if after[k] != before[k]} == {"out/_manifest.json"}
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"], c["already_done"]) == (23, 0, 8, 15)
    assert len(manifest["runs"]) == 3

    out, err = capfd.readouterr()
    assert SECRET_KEY not in out + err


# ------------------------------------------------------------------ local output folders


def write_corpus(path, records) -> str:
    path.write_bytes(jsonl([line(r) for r in records]))
    return str(path)


def local_config(corpus: str, output, model_dir, **kw) -> JobConfig:
    settings = {"budgets": BUDGETS, "batch_size": 8, **kw}
    return validate(JobConfig(input=[corpus], output=str(output), model=str(model_dir),
                              **settings))


def test_unfinished_run_is_completed_without_duplicates(local_ray, model_dir, tmp_path):
    records = rows(4, 8, "d")
    corpus = write_corpus(tmp_path / "corpus.jsonl", records)
    out = tmp_path / "out"
    compress.run(local_config(corpus, out, model_dir, limit=3))
    # What a crash before the end leaves: no manifest, an sft/ file whose data/ file never
    # came, and a temporary file.
    (out / "_manifest.json").unlink()
    (out / "sft" / "crashed-0000.jsonl").write_text(json.dumps({"id": "d5"}) + "\n")
    (out / "data" / "_tmp-crashed.parquet").write_bytes(b"PAR1 half")

    manifest = compress.run(local_config(corpus, out, model_dir))
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["already_done"], c["rejected"]) == (8, 5, 3, 0)
    assert manifest["totals"]["rows_per_budget"] == {"0.5": 8, "0.8": 8}
    assert manifest["totals"]["duplicate_rows"] == 0
    assert manifest["totals"]["sft_records"] == 8 * 3
    assert not (out / "sft" / "crashed-0000.jsonl").exists()
    assert not (out / "data" / "_tmp-crashed.parquet").exists()
    assert manifest["runs"][0]["run_id"] is None  # the unfinished run, noted
    assert (out / "_manifest.json").exists() and not (out / "_manifest.previous.json").exists()

    # Refresh refuses other settings; overwrite starts over.
    with pytest.raises(ConfigError, match="budgets"):
        compress.run(local_config(corpus, out, model_dir, budgets=[0.5]))
    manifest = compress.run(local_config(corpus, out, model_dir, budgets=[0.5], mode="overwrite",
                                         sft_format="tokenskip", sft_mix="all"))
    assert manifest["counts"]["scored"] == 8 and len(manifest["runs"]) == 1
    assert manifest["totals"]["rows_per_budget"] == {"0.5": 8}
    sft = [json.loads(x) for p in (out / "sft").glob("*.jsonl") for x in p.read_text().splitlines()]
    assert Counter(r["budget"] for r in sft) == {0.5: 8, 1.0: 8}
    assert all(r["input"].endswith("<|eot_id|>0.5<|eot_id|>") for r in sft if r["budget"] == 0.5)
    info = json.loads((out / "dataset_info.json").read_text())  # for LLaMA-Factory
    assert info["mist"]["file_name"] == "sft" and info["mist"]["formatting"] == "alpaca"


def test_overwrite_refuses_a_foreign_folder(local_ray, model_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", rows(5, 2, "e"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        compress.run(local_config(corpus, tmp_path / "out", model_dir, mode="overwrite"))
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_counts_that_do_not_reconcile_fail_the_run(local_ray, model_dir, tmp_path, monkeypatch):
    """A row added to the input between the planning pass and the work is a row the plan
    never counted: the run must fail, and leave no manifest."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, rows(6, 3, "f"))
    real = compress.make_plan

    def plan_then_append(*args, **kwargs):
        plan = real(*args, **kwargs)
        with open(corpus, "ab") as f:
            f.write(line(rows(7, 1, "g")[0]) + b"\n")
        return plan

    monkeypatch.setattr(compress, "make_plan", plan_then_append)
    out = tmp_path / "out"
    with pytest.raises(compress.AccountingError, match="rows read"):
        compress.run(local_config(str(corpus), out, model_dir))
    assert not (out / "_manifest.json").exists()
