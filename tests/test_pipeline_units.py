"""The compression job's parts that need no Ray: output formats, the demo corpus, settings,
URIs, the JSONL reader, row validation, and the accounting check."""
from __future__ import annotations

import io
import json
import re
from collections import Counter
from dataclasses import replace

import pyarrow as pa
import pytest

from mist_core import get_adapter
from mist_core.data.demo import demo_corpus
from mist_core.data.formats import (budget_label, data_rows, data_schema, directive, extra_name,
                                    extra_value, fits, kinds_type, pick_budget, sft_messages,
                                    sft_records, sft_tokenskip, value_kind)
from pipelines.common import storage
from pipelines.cli import main as cli_main
from pipelines.job.compress import AccountingError, Plan, reconcile
from pipelines.job.compress import parse_args
from pipelines.common.settings import ConfigError, from_mapping
from pipelines.job.config import JobConfig
from pipelines.job.output import Existing
from pipelines.job.sink import WriteStats
from pipelines.common.sources import jsonl_lines, parse_hf
from pipelines.common.rows import parse_row

# ------------------------------------------------------------------ formats


@pytest.mark.parametrize("budget, text", [
    (0.5, "Please reduce 50% of the tokens in your CoT."),
    (0.7, "Please reduce 30% of the tokens in your CoT."),
    (0.9, "Please reduce 10% of the tokens in your CoT."),
    (0.55, "Please reduce 45% of the tokens in your CoT."),
])
def test_directive_follows_the_paper_in_the_budget_unit(budget, text):
    assert directive(budget) == text


def test_no_directive_at_full_chain():
    assert directive(1.0) is None
    rec = sft_messages(id="a", question="Q?", cot="step", answer="4", budget=1.0)
    assert rec["messages"][0] == {"role": "user", "content": "Q?"}
    assert rec["messages"][1] == {"role": "assistant", "content": "step\n\nThe answer is 4"}


def test_chat_record_carries_directive_and_chain():
    rec = sft_messages(id="a", question="Q?", cot="short", answer="4", budget=0.6)
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
    assert rec["messages"][0]["content"] == "Q?\n\nPlease reduce 40% of the tokens in your CoT."
    assert rec["messages"][1]["content"].startswith("short\n\n")
    assert rec["budget"] == 0.6 and rec["id"] == "a"


def test_tokenskip_record():
    rec = sft_tokenskip(id="a", question="Q?", cot="c", answer="7", budget=0.7)
    assert rec["input"] == "Q?<|eot_id|>0.7<|eot_id|>"
    assert rec["output"] == "c\n\nThe final answer is: $\\boxed{7}$"
    assert set(rec) == {"id", "budget", "instruction", "input", "output"}
    assert sft_tokenskip(id="a", question="Q?", cot="c", answer="7", budget=1.0)["input"] == "Q?"


def test_sft_mix_all_and_sample():
    compressed = {0.5: "half", 0.8: "most"}
    every = sft_records(id="x", question="Q", cot=" full ", answer="1", compressed=compressed,
                        mix="all")
    assert [r["budget"] for r in every] == [0.5, 0.8, 1.0]
    assert [r["completion"][0]["content"].split("\n\n")[0] for r in every] == \
        ["half", "most", "full"]
    assert every == sft_records(id="x", question="Q", cot=" full ", answer="1",
                                compressed=compressed)  # the default
    one = sft_records(id="x", question="Q", cot="full", answer="1", compressed=compressed,
                      mix="sample")
    assert len(one) == 1 and one == sft_records(id="x", question="Q", cot="full", answer="1",
                                                compressed=compressed, mix="sample")
    with pytest.raises(ValueError):
        sft_records(id="x", question="Q", cot="c", answer="1", compressed={}, fmt="sharegpt")


def test_budget_draw_is_stable_and_roughly_uniform():
    choices = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    draws = Counter(pick_budget(f"id-{i}", choices) for i in range(6000))
    assert set(draws) == set(choices)
    assert all(800 < n < 1200 for n in draws.values())
    assert pick_budget("id-1", choices) == pick_budget("id-1", choices)


def test_budget_label_has_no_float_noise():
    assert budget_label(0.1 + 0.2) == "0.3"
    assert budget_label(0.7) == "0.7" and budget_label(1.0) == "1"


def test_extra_columns_types():
    assert [value_kind(v) for v in (None, True, 3, 2.5, "s", [1], {"a": 1})] == \
        ["null", "bool", "int", "float", "str", "json", "json"]
    assert kinds_type({"int"}) == pa.int64()
    assert kinds_type({"int", "float", "null"}) == pa.float64()
    assert kinds_type({"bool"}) == pa.bool_()
    assert kinds_type({"int", "str"}) == pa.string()
    assert kinds_type({"null"}) == pa.string()
    assert extra_value([1, 2], pa.string()) == "[1, 2]"
    assert extra_value(3, pa.float64()) == 3.0 and isinstance(extra_value(3, pa.float64()), float)
    assert fits({"int"}, pa.float64()) and not fits({"str"}, pa.int64())
    assert extra_name("budget") == "input_budget" and extra_name("topic") == "topic"


def test_data_rows_one_per_budget_with_extras():
    extras = pa.schema([("level", pa.int64()), ("tags", pa.string())])
    rows = data_rows(id="a", question="q", cot="c", answer="1", budgets=[0.5, 0.9],
                     compressed=["x", "xy"], kept_tokens=[2, 4], cot_tokens=4, method="mist",
                     model="m", extras={"level": 3, "tags": ["a"]}, extras_schema=extras)
    table = pa.Table.from_pylist(rows, schema=data_schema(extras))
    assert table.num_rows == 2
    assert table.column("budget").to_pylist() == [0.5, 0.9]
    assert table.column("tags").to_pylist() == ['["a"]', '["a"]']
    assert table.schema.names[:12] == ["id", "question", "cot", "answer", "budget",
                                       "compressed_cot", "kept_tokens", "cot_tokens",
                                       "kept_words", "cot_words", "method", "model"]
    assert table.column("kept_words").to_pylist() == [1, 1]

# ------------------------------------------------------------------ demo corpus


def test_demo_corpus_is_deterministic_and_correct():
    rows = demo_corpus(48, seed=0)
    assert rows == demo_corpus(48, seed=0)
    assert rows != demo_corpus(48, seed=1)
    assert len({r["id"] for r in rows}) == 48
    assert len({r["topic"] for r in rows}) == 6
    adapt = get_adapter("generic")
    for r in rows:
        ex = adapt(r)
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)", ex.cot)
        assert len(steps) >= 2, ex.cot  # multi-step
        for a, op, b, c in steps:
            assert eval(f"{a} {op} {b}") == int(c), ex.cot
        assert int(steps[-1][3]) == int(ex.answer)

# ------------------------------------------------------------------ settings


def test_defaults_run_the_demo():
    cfg = parse_args([])
    assert cfg.input == ["demo"] and cfg.model == "smollm2-135m-instruct"
    assert cfg.output == "outputs/demo" and cfg.mode == "refresh"
    assert cfg.budgets == [0.5, 0.6, 0.7, 0.8, 0.9]


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("input: [s3://b/x.jsonl, hf://openai/gsm8k:main@test]\nadapter: gsm8k\n"
                    "budgets: [0.9, 0.5]\nbatch-size: 8\nactors: 1,4\ngpus_per_actor: 1\n"
                    "mode: overwrite\n")
    cfg = parse_args(["--config", str(path), "--batch-size", "16", "--budgets", "0.7"])
    assert cfg.input == ["s3://b/x.jsonl", "hf://openai/gsm8k:main@test"]
    assert cfg.adapter == "gsm8k" and cfg.mode == "overwrite"
    assert cfg.batch_size == 16 and cfg.budgets == [0.7]
    assert cfg.actors == (1, 4) and cfg.gpus_per_actor == 1.0
    cfg = parse_args(["--config", str(path)])
    assert cfg.budgets == [0.5, 0.9] and cfg.batch_size == 8


@pytest.mark.parametrize("values, message", [
    ({"budgets": "0.5,1.5"}, "budgets"),
    ({"budgets": "half"}, "budgets"),
    ({"actors": "3,1"}, "actors"),
    ({"bogus": 1}, "unknown setting"),
    ({"adapter": "gsm8k", "columns": "question=q"}, "generic"),
    ({"columns": "question=q,prompt=p"}, "columns"),
    ({"method": "magic"}, "method"),
    ({"limit": 0}, "limit"),
    ({"device": "tpu"}, "device must be one of auto, cpu, cuda"),
    ({"device": "cuda", "gpus_per_actor": 0}, "device cuda needs a GPU"),
])
def test_bad_settings_say_why(values, message):
    from pipelines.common.settings import validate

    with pytest.raises(ConfigError, match=message):
        validate(from_mapping(values, kind=JobConfig))


def test_columns_mapping():
    cfg = parse_args(["--columns", "question=prompt,cot=reasoning,answer=final,id=uid"])
    assert cfg.columns == {"question": "prompt", "cot": "reasoning", "answer": "final", "id": "uid"}


def test_cli_dispatch(capsys):
    assert cli_main([]) == 2
    assert "compress" in capsys.readouterr().out
    assert cli_main(["frobnicate"]) == 2
    with pytest.raises(SystemExit) as e:
        cli_main(["compress", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mist compress") and "--input" in out and "--budgets" in out


def test_bad_config_file_exits_2(tmp_path, capsys):
    from pipelines.job.compress import main

    (tmp_path / "bad.yaml").write_text("budgets: [2.0]\n")
    assert main(["--config", str(tmp_path / "bad.yaml")]) == 2
    assert "budgets must lie in (0, 1]" in capsys.readouterr().err


def test_device_setting_and_how_it_resolves(tmp_path):
    from pipelines.job.placement import resolve_device

    assert parse_args([]).device == "auto"
    assert parse_args(["--device", "cpu", "--gpus-per-actor", "1"]).device == "cpu"
    (tmp_path / "job.yaml").write_text("device: cuda\ngpus-per-actor: 1\n")
    assert parse_args(["--config", str(tmp_path / "job.yaml")]).device == "cuda"
    # auto: today's rule, by the GPUs Ray gives each actor
    assert resolve_device("auto", 1.0) == "cuda" and resolve_device("auto", 0.5) == "cuda"
    assert resolve_device("auto", 0.0) == "cpu"
    assert resolve_device("cpu", 1.0) == "cpu" and resolve_device("cuda", 1.0) == "cuda"
    with pytest.raises(ConfigError, match="--device cuda needs a GPU"):
        resolve_device("cuda", 0.0)  # gpus_per_actor auto on a cluster without GPUs

# ------------------------------------------------------------------ storage and URIs


def test_s3_filesystem_uses_endpoint_env(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    fs, path, prefix = storage.filesystem("s3://bucket/some/dir/")
    assert (path, prefix) == ("bucket/some/dir", "s3://")
    _, (kwargs,) = fs.__reduce__()[:2]
    assert kwargs["endpoint_override"] == "127.0.0.1:9" and kwargs["scheme"] == "http"
    assert kwargs["region"] == "us-east-1"
    assert kwargs.get("access_key") in (None, "") and kwargs.get("secret_key") in (None, "")


def test_uris(tmp_path):
    assert storage.filesystem(f"file://{tmp_path}/x")[1] == f"{tmp_path}/x"
    assert storage.filesystem(str(tmp_path))[1] == str(tmp_path)
    with pytest.raises(ValueError, match="unsupported URI scheme"):
        storage.filesystem("ftp://host/x")
    assert storage.redact("s3://KEY:SECRET@bucket/x") == "s3://***@bucket/x"
    assert parse_hf("hf://openai/gsm8k:main@test") == ("openai/gsm8k", "main", "test")
    assert parse_hf("hf://HuggingFaceH4/MATH-500") == ("HuggingFaceH4/MATH-500", None, "train")
    assert [storage.detect_format(n) for n in ("a.jsonl", "a.json.gz", "a.parquet", "a.csv")] == \
        ["jsonl", "jsonl", "parquet", None]


def test_input_listing_skips_hidden_and_other_files(tmp_path):
    (tmp_path / "b.jsonl").write_text("{}\n")
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "README.md").write_text("x")
    (tmp_path / "_tmp-c.jsonl").write_text("{}\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "d.jsonl").write_text("{}\n")
    _, files, _ = storage.input_files(str(tmp_path))
    assert [(p.rsplit("/", 1)[1], f) for p, f in files] == [("a.parquet", "parquet"),
                                                           ("b.jsonl", "jsonl")]
    with pytest.raises(FileNotFoundError):
        storage.input_files(str(tmp_path / "missing"))

# ------------------------------------------------------------------ reading and validation


def test_jsonl_lines_keep_line_numbers():
    data = b"\xef\xbb\xbf{\"a\": 1}\r\n\n   \n{\"b\": 2}\n\xff\xfe\n{\"c\": 3}"
    for chunk in (1, 3, 1 << 20):  # lines split across reads
        assert list(jsonl_lines(io.BytesIO(data), chunk=chunk)) == [
            (1, b'{"a": 1}'), (4, b'{"b": 2}'), (5, b"\xff\xfe"), (6, b'{"c": 3}')]
    assert list(jsonl_lines(io.BytesIO(b""))) == []


@pytest.mark.parametrize("raw, reason", [
    (b"\xff{}", "invalid_utf8"),
    (b'{"question": ', "invalid_json"),
    (b"[1, 2]", "not_an_object"),
    (b'"text"', "not_an_object"),
    (b'{"question": "q", "answer": "1"}', "missing_column"),
    (b'{"question": "q", "cot": "  ", "answer": "1"}', "empty_cot"),
    (b'{"question": "q", "cot": 5, "answer": "1"}', "cot_not_string"),
    (b'{"question": "q", "cot": "c", "answer": "1", "id": [1]}', "id_not_string"),
])
def test_parse_row_rejects_with_reason(raw, reason):
    from mist_core import InvalidExample

    with pytest.raises(InvalidExample) as e:
        parse_row(raw, "generic", {})
    assert e.value.reason == reason


def test_parse_row_extras_and_mapping():
    raw = json.dumps({"prompt": "q", "why": "c", "final": "1", "uid": 7, "level": 2,
                      "budget": "x", "__index_level_0__": 0}).encode()
    ex, extras = parse_row(raw, "generic", {"question": "prompt", "cot": "why", "answer": "final",
                                            "id": "uid"})
    assert (ex.question, ex.cot, ex.answer, ex.key) == ("q", "c", "1", "7")
    assert extras == {"level": 2, "input_budget": "x"}
    ex, extras = parse_row(json.dumps({"question": "q", "answer": "a\n#### 5", "src": "x"}).encode(),
                           "gsm8k", {})
    assert ex.answer == "5" and extras == {"src": "x"}

# ------------------------------------------------------------------ accounting


def _plan(read, done=0, invalid=0):
    return Plan(read=read, examples=read, invalid=invalid, done=done, duplicates=0,
                to_score=read - done,
                row_limits=None, dup_rows=frozenset(), extras=pa.schema([]), seconds=0.0)


def _totals(per_budget, sft, rejects=0, dups=0):
    return {"rows_per_budget": per_budget, "duplicate_rows": dups, "sft_records": sft,
            "rejects": rejects}


def test_reconcile_accepts_matching_counts():
    cfg = JobConfig(budgets=[0.5, 0.9])  # sft_mix "all": 3 records an example
    stats = WriteStats(rows=5, scored=4, rejected=1, rejects_written=1, sft=12,
                       written=Counter({"0.5": 4, "0.9": 4}))
    reconcile(cfg, _plan(5, invalid=1), stats, Existing(), _totals({"0.5": 4, "0.9": 4}, 12, 1))
    one = JobConfig(budgets=[0.5, 0.9], sft_mix="sample")  # one record an example
    reconcile(one, _plan(5, invalid=1), replace(stats, sft=4), Existing(),
              _totals({"0.5": 4, "0.9": 4}, 4, 1))


@pytest.mark.parametrize("change, message", [
    (dict(rows=4, scored=3), "rows that reached the writer"),  # a row lost on the way
    (dict(written=Counter({"0.5": 4, "0.9": 3})), "budget 0.9"),
    (dict(sft=11), "sft records written"),
    (dict(sft=4), "sft records written"),  # one an example where sft_mix "all" writes three
])
def test_reconcile_fails_loudly(change, message):
    cfg = JobConfig(budgets=[0.5, 0.9])
    base = dict(rows=5, scored=4, rejected=1, rejects_written=1, sft=12,
                written=Counter({"0.5": 4, "0.9": 4}))
    stats = WriteStats(**{**base, **change})
    with pytest.raises(AccountingError, match=re.escape(message)):
        reconcile(cfg, _plan(5, invalid=1), stats, Existing(),
                  _totals({"0.5": 4, "0.9": 4}, 12, 1))


def test_reconcile_catches_duplicates_in_output():
    cfg = JobConfig(budgets=[0.5])
    stats = WriteStats(rows=2, scored=2, sft=4, written=Counter({"0.5": 2}))
    with pytest.raises(AccountingError, match="duplicate"):
        reconcile(cfg, _plan(2), stats, Existing(), _totals({"0.5": 2}, 4, dups=1))

# ------------------------------------------------------------------ shipped configuration


def test_example_config_is_valid():
    from pathlib import Path

    cfg = parse_args(["--config", str(Path(__file__).parents[1] / "pipelines/job/configs/gsm8k.yaml")])
    assert cfg.adapter == "gsm8k" and cfg.gpus_per_actor == 1.0 and cfg.actors == (1, 4)


def test_cluster_yaml_matches_ray_schema():
    import os
    from pathlib import Path

    import jsonschema
    import ray.autoscaler
    import yaml

    schema = json.loads((Path(os.path.dirname(ray.autoscaler.__file__)) / "ray-schema.json").read_text())
    cluster = yaml.safe_load((Path(__file__).parents[1] / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    assert cluster["provider"]["type"] == "aws"
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert not head["node_config"]["InstanceType"].startswith(("g", "p"))  # a CPU head
    gpu = cluster["available_node_types"]["gpu_worker"]
    assert gpu["min_workers"] == 0 < gpu["max_workers"]  # autoscaling GPU workers
    assert gpu["node_config"]["InstanceType"].startswith(("g", "p"))
    assert any("pip install" in c and "/home/ray/mist" in c for c in cluster["setup_commands"])


def test_hugging_face_input(tmp_path, monkeypatch):
    """hf://… goes through `datasets`; a local dataset folder stands in for the Hub."""
    import datasets

    from pipelines.common.sources import hf_table

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "ds"
    folder.mkdir()
    rows = demo_corpus(3, seed=9)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = hf_table(f"hf://{folder}@train", 2)
    assert table.column("row").to_pylist() == [1, 2, 3]
    assert table.column("input").to_pylist() == [2, 2, 2]
    assert [json.loads(b) for b in table.column("raw").to_pylist()] == rows
