"""No passthrough value is lost: an input column named like an output column is written with
the prefix `input_`, and a row where that gives two columns one name (`budget` beside
`input_budget`) is rejected as column_collision, naming both, instead of one value
silently overwriting the other."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from mist_core import InvalidExample
from mist_core.data.formats import DATA_COLUMNS, EXTRA_PREFIX
from pipelines.common.rows import parse_examples

ROW = {"id": "a", "question": "What is 2 + 2?", "cot": "2 + 2 = 4.", "answer": "4"}


def _parse(row: dict):
    return parse_examples(json.dumps(row).encode(), "generic", {})


@pytest.mark.parametrize("extra", [{"budget": 1, "input_budget": 2},
                                   {"input_budget": 2, "budget": 1},
                                   {"model": "m", "input_model": "n"}])
def test_colliding_columns_reject_the_row_naming_both(extra):
    with pytest.raises(InvalidExample) as e:
        _parse(ROW | extra)
    assert e.value.reason == "column_collision"
    names = sorted(extra)
    assert all(repr(n) in e.value.detail for n in names), e.value.detail


def test_a_prefixed_column_alone_passes_through():
    _, extras = _parse(ROW | {"budget": 1, "input_model": "n", "topic": "t"})
    assert extras == {"input_budget": 1, "input_model": "n", "topic": "t"}


_names = st.one_of(st.sampled_from(list(DATA_COLUMNS) + [EXTRA_PREFIX + c for c in DATA_COLUMNS]
                                   + ["topic", "input_", "input_input_budget"]),
                   st.text(st.characters(blacklist_categories=("Cs",)), max_size=6))


@settings(max_examples=200, deadline=None, database=None)
@given(extra=st.dictionaries(_names, st.integers(), max_size=6))
def test_property_every_extra_value_is_kept_or_the_row_rejected(extra):
    row = ROW | {k: v for k, v in extra.items() if k not in ROW}
    try:
        _, extras = _parse(row)
    except InvalidExample as e:
        assert e.reason == "column_collision"
        return
    passed = {k: v for k, v in row.items() if k not in ROW}
    # every value is in the output, under a name no output column has, once
    assert sorted(map(str, extras.values())) == sorted(map(str, passed.values()))
    assert not set(extras) & set(DATA_COLUMNS)


@pytest.mark.integration
def test_the_job_rejects_a_colliding_row_and_reconciles(local_ray, tmp_path, model_dir):
    from pipelines.job import compress
    from pipelines.common import storage
    from pipelines.job.config import JobConfig
    from pipelines.common.settings import validate

    corpus = tmp_path / "c.jsonl"
    rows = [ROW | {"id": "ok", "budget": "mine"},
            ROW | {"id": "clash", "budget": "b", "input_budget": "ib"},
            ROW | {"id": "ok2", "input_budget": "only"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = compress.run(validate(JobConfig(
        input=[str(corpus)], output=str(tmp_path / "out"), model=str(model_dir),
        budgets=[0.5], unit="token", batch_size=4)))
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (3, 2, 1)
    fs, root, _ = storage.filesystem(str(tmp_path / "out" / "rejects"))
    [reject] = storage.read_parquet_dir(fs, root).to_pylist()
    assert (reject["id"], reject["reason"]) == ("clash", "column_collision")
    assert "'budget'" in reject["detail"] and "'input_budget'" in reject["detail"]
    fs, root, _ = storage.filesystem(str(tmp_path / "out" / "data"))
    data = {r["id"]: r for r in storage.read_parquet_dir(fs, root).to_pylist()}
    assert data["ok"]["input_budget"] == "mine" and data["ok2"]["input_budget"] == "only"
