"""Hostile and malformed input: every input row gets exactly one fate (scored into data/,
rejected into rejects/ with a specific reason, or already done), good rows next to bad ones
are unaffected, and the counts reconcile.

One job run over a folder mixing JSONL (plain and gzip) and parquet files holds every case
(module-scoped fixture); each test checks one case on it. A few cases need a run of their
own (a folder of empty files only, a corrupt gzip), and a property-based test runs the real
job on generated corpora."""
from __future__ import annotations

import gzip
import io
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from mist_core.data.demo import demo_corpus
from mist_core.data.examples import stable_id
from mist_core.data.formats import extra_value, kinds_type, value_kind
from pipelines.job import compress
from pipelines.common import storage
from pipelines.job.config import JobConfig
from pipelines.common.settings import validate

BUDGETS = [0.5, 0.8]


def config(corpus, output, model_dir) -> JobConfig:
    return validate(JobConfig(input=[str(corpus)], output=str(output), model=str(model_dir),
                              budgets=BUDGETS, unit="token", batch_size=16))


def read_dir(out: Path, sub: str) -> list[dict]:
    fs, root, _ = storage.filesystem(str(out / sub))
    table = storage.read_parquet_dir(fs, root)
    return [] if table is None else table.to_pylist()


# ------------------------------------------------------------------ the corpus

GOOD = demo_corpus(100, seed=11)
_next = iter(range(len(GOOD)))


def good(id=..., **changes) -> dict:
    """A fresh demo row (scorable with the tiny model), with its id and fields changed."""
    row = dict(GOOD[next(_next)])
    if id is not ...:
        row["id"] = id
    row.update(changes)
    return {k: v for k, v in row.items() if v is not ...}


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


@dataclass
class Entry:
    case: str
    payload: object  # a row dict, or the raw bytes of a JSONL line
    expect: str | set  # "ok", a reject reason, or a set of acceptable outcomes
    id: str | None = None  # the id a scored row must have (default: the row's id)


# JSONL lines: one entry per line, so line number = position.
A = [
    Entry("good", good(id="a0"), "ok"),
    Entry("missing_column", dumps({"question": "q", "answer": "1"}), "missing_column"),
    Entry("missing_column", dumps({}), "missing_column"),
    Entry("missing_column", dumps(good(question=None)), "missing_column"),
    Entry("extra_columns", good(id="a-extra", difficulty=3, tags=["x", "y"], meta={"k": [1]},
                                budget="mine", flag=True, ratio=0.25), "ok"),
    Entry("wrong_type", good(question=42), "question_not_string"),
    Entry("wrong_type", good(cot=["step one", "step two"]), "cot_not_string"),
    Entry("wrong_type", good(answer={"value": 7}), "answer_not_string"),
    Entry("wrong_type", good(answer=True), "answer_not_string"),
    Entry("wrong_type", good(id=True), "id_not_string"),
    Entry("wrong_type", good(id=1.5), "id_not_string"),
    Entry("wrong_type", good(id=["a"]), "id_not_string"),
    Entry("numeric_id", good(id=12345), "ok", id="12345"),
    Entry("empty", good(question=""), "empty_question"),
    Entry("empty", good(cot=" \t\n "), "empty_cot"),
    Entry("empty", good(answer=""), "empty_answer"),
    Entry("empty", good(id=""), "empty_id"),
    Entry("empty", good(id="   "), "empty_id"),
    Entry("empty", good(cot="\u200b\u200b"), "cot_no_tokens"),  # the tokenizer drops ZWSP
    Entry("null_byte", good(cot="nine\u0000ten"), "null_byte_in_cot"),
    Entry("null_byte", good(question="\u0000"), "null_byte_in_question"),
    Entry("null_byte", b'{"question": "raw \x00 byte", "cot": "c", "answer": "1"}', "invalid_json"),
    Entry("invalid_utf8", b'{"question": "caf\xe9?", "cot": "c", "answer": "1"}', "invalid_utf8"),
    Entry("invalid_utf8", b'{"question": "over\xc0\xaflong", "cot": "c", "answer": "1"}',
          "invalid_utf8"),
    Entry("invalid_json", b'{"question": "broken', "invalid_json"),
    Entry("invalid_json", dumps(good()) + b" trailing", "invalid_json"),
    Entry("invalid_json", b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
          "invalid_json"),  # nested too deeply for json.loads
    Entry("not_an_object", b'["q", "c", "1"]', "not_an_object"),
    Entry("not_an_object", b'"just a string"', "not_an_object"),
    Entry("not_an_object", b"null", "not_an_object"),
    Entry("too_long", good(id="a-long", cot=" ".join(["step"] * 400)), "too_long"),
    Entry("long_word", good(id="a-word", cot="x" * 5000), {"ok", "too_long"}),
    Entry("long_word", good(id="a-word-short", cot="7" * 120), {"ok", "too_long"}),
    Entry("unicode", good(id="a-arabic", question="كم عدد التفاح؟", cot="لدينا ٣ + ٤ = ٧ تفاحات.",
                          answer="٧"), "ok"),
    Entry("unicode", good(id="a-hebrew", cot="\u202eיש לנו 3 ועוד 4 = 7 תפוחים\u202c"), "ok"),
    Entry("unicode", good(id="a-combining", cot="Z\u0351\u0352a\u0301\u0302\u0303l"
                          "\u0304g\u0305o\u0306 then e\u0301 = 9 - 2"), "ok"),
    Entry("unicode", good(id="a-emoji", cot="👩‍👩‍👧‍👦 has 4 people, 🇫🇷 + 🏳️‍🌈 make 2 flags."),
          "ok"),
    Entry("unicode", good(id="a-bom", cot="in\ufeffside and \u200d joiner 3 + 4 = 7"), "ok"),
    # An escaped surrogate pair is a real character; a lone one has no UTF-8 form.
    Entry("unicode", json.dumps(good(id="a-pair", cot="\U0001F600 smiles 2 + 2 = 4"),
                                ensure_ascii=True).encode(), "ok", id="a-pair"),
    Entry("lone_surrogate", json.dumps(good(question="half \ud800 of it")).encode(),
          "lone_surrogate"),
    Entry("lone_surrogate", json.dumps(good(cot="low \udc00 one")).encode(), "lone_surrogate"),
    Entry("lone_surrogate", json.dumps(good(id="a-sur", **{"note\udbff": 1})).encode(),
          "lone_surrogate"),
    Entry("lone_surrogate", json.dumps(good(id="bad-\ud800")).encode(), "lone_surrogate"),
    Entry("duplicate_id", good(id="a0"), "duplicate_id"),  # within the file
    Entry("duplicate_id", good(id="a-twice", question=5), "question_not_string"),
    Entry("duplicate_id", good(id="a-twice"), "ok"),  # the first *valid* row with this id wins
    Entry("duplicate_id", GOOD[0] | {"id": None}, "ok", id=stable_id(
        GOOD[0]["question"], GOOD[0]["cot"], GOOD[0]["answer"])),  # no id: a hash of the texts
    Entry("duplicate_id", GOOD[0] | {"id": None}, "duplicate_id"),
]
# Parquet: typed columns, so only wrong values that a string column can hold.
B = [
    Entry("mixed_formats", good(id="b0"), "ok"),
    Entry("duplicate_id", good(id="a1-parquet") | {"id": "a0"}, "duplicate_id"),  # JSONL, parquet
    Entry("missing_column", good(cot=None), "missing_column"),
    Entry("empty", good(question="  "), "empty_question"),
    Entry("null_byte", good(answer="4\u00002"), "null_byte_in_answer"),
    Entry("mixed_formats", good(id="b1"), "ok"),
]
C = [
    Entry("duplicate_id", good(id="a-extra"), "duplicate_id"),  # across JSONL files
    Entry("duplicate_id", good(id="b1"), "duplicate_id"),  # parquet, then JSONL
    Entry("duplicate_id", good(id="12345"), "duplicate_id"),  # numeric id 12345 came first
    Entry("mixed_formats", good(id="c0"), "ok"),
]
GZ = [Entry("mixed_formats", good(id="gz0"), "ok"), Entry("mixed_formats", good(id="gz1"), "ok")]
DAMAGED = [good(id=f"dmg{i}") for i in range(6)]  # 3 row groups of 2 rows; group 2 damaged


def jsonl(entries: list[Entry]) -> bytes:
    return b"".join((e.payload if isinstance(e.payload, bytes) else dumps(e.payload)) + b"\n"
                    for e in entries)


def parquet(rows: list[dict], schema: pa.Schema | None = None, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf, **kw)
    return buf.getvalue()


def damaged_parquet(rows: list[dict]) -> bytes:
    """A parquet file whose second row group holds a string value with an impossible
    length, which pyarrow reports as ArrowInvalid when it reaches that group."""
    b = bytearray(parquet(rows, row_group_size=2, compression="none", use_dictionary=False,
                          write_statistics=False))
    meta = pq.ParquetFile(io.BytesIO(bytes(b))).metadata
    col = meta.row_group(1).column(meta.schema.names.index("cot"))
    at = b.find(rows[2]["cot"].encode(), col.data_page_offset)
    assert at > 0
    b[at - 4:at] = (2**31 - 1).to_bytes(4, "little")  # the PLAIN length prefix of row 3's cot
    return bytes(b)


def expected_fates() -> dict[tuple[str, int], Entry]:
    out = {}
    for name, entries in (("a.jsonl", A), ("b.parquet", B), ("c.jsonl", C), ("k.jsonl.gz", GZ)):
        for i, e in enumerate(entries, 1):
            out[(name, i)] = e
    for i in (1, 2):
        out[("j_damaged.parquet", i)] = Entry("corrupt_parquet", DAMAGED[i - 1], "ok")
    out[("j_damaged.parquet", 3)] = Entry("corrupt_parquet", None, "unreadable_file")
    for name in ("g_random.parquet", "h_truncated.parquet", "i_zero_bytes.parquet"):
        out[(name, 1)] = Entry("corrupt_parquet", None, "unreadable_file")
    return out


@dataclass
class Run:
    manifest: dict
    data: list[dict]
    rejects: dict[tuple[str, int], dict]
    fates: dict[tuple[str, int], Entry]


@pytest.fixture(scope="module")
def job(local_ray, model_dir, tmp_path_factory) -> Run:
    base = tmp_path_factory.mktemp("hostile")
    corpus = base / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(jsonl(A))
    (corpus / "b.parquet").write_bytes(parquet([e.payload for e in B]))
    (corpus / "c.jsonl").write_bytes(jsonl(C))
    (corpus / "d_empty.jsonl").write_bytes(b"")
    (corpus / "e_blank_lines.jsonl").write_bytes(b"\n  \n\r\n\n")
    (corpus / "f_no_rows.parquet").write_bytes(parquet([], schema=pa.schema([("id", pa.string())])))
    (corpus / "g_random.parquet").write_bytes(os.urandom(2048))
    real = parquet([good(id=f"h{i}") for i in range(3)])
    (corpus / "h_truncated.parquet").write_bytes(real[: len(real) // 2])
    (corpus / "i_zero_bytes.parquet").write_bytes(b"")
    (corpus / "j_damaged.parquet").write_bytes(damaged_parquet(DAMAGED))
    (corpus / "k.jsonl.gz").write_bytes(gzip.compress(jsonl(GZ)))
    out = base / "out"
    manifest = compress.run(config(corpus, out, model_dir))
    rejects = {}
    for r in read_dir(out, "rejects"):
        key = (r["source"].rsplit("/", 1)[1], r["row"])
        assert key not in rejects, f"{key} rejected twice"
        rejects[key] = r
    return Run(manifest, read_dir(out, "data"), rejects, expected_fates())


CASES = sorted({e.case for e in expected_fates().values()})


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES)
def test_each_row_gets_its_fate(job, case):
    data_ids = Counter(r["id"] for r in job.data)
    checked = 0
    for (name, row), e in job.fates.items():
        if e.case != case:
            continue
        checked += 1
        where = f"{name} row {row} ({case})"
        rej = job.rejects.get((name, row))
        allowed = {e.expect} if isinstance(e.expect, str) else e.expect
        if rej is not None:
            assert rej["reason"] in allowed, f"{where}: rejected as {rej['reason']}: {rej['detail']}"
            assert rej["raw"] is not None
        else:
            assert "ok" in allowed, f"{where}: expected {allowed}, not rejected"
            id_ = e.id or e.payload["id"]
            assert data_ids[id_] == len(BUDGETS), f"{where}: id {id_} not scored once per budget"
    assert checked


@pytest.mark.integration
def test_counts_reconcile_and_no_row_is_lost(job):
    c = job.manifest["counts"]
    assert c["read"] == len(job.fates)  # the empty files add no rows
    assert c["read"] == c["scored"] + c["rejected"] + c["already_done"]
    assert c["already_done"] == 0
    assert set(job.rejects) <= set(job.fates)
    assert c["rejected"] == len(job.rejects)
    assert c["scored"] == len(job.fates) - len(job.rejects)
    assert c["written_per_budget"] == {str(b): c["scored"] for b in BUDGETS}
    pairs = Counter((r["id"], r["budget"]) for r in job.data)
    assert max(pairs.values()) == 1
    assert sum(c["rejected_by_reason"].values()) == c["rejected"]


@pytest.mark.integration
def test_unreadable_parquet_files(job):
    """Random bytes, a truncated file and an empty file: one reject each, at row 1. A file
    damaged in its second row group: the rows before it are scored, the reject is row 3."""
    for name in ("g_random.parquet", "h_truncated.parquet", "i_zero_bytes.parquet",
                 "j_damaged.parquet"):
        rej = [r for (n, _), r in job.rejects.items() if n == name]
        assert len(rej) == 1 and rej[0]["reason"] == "unreadable_file", name
        assert rej[0]["detail"].startswith("ArrowInvalid: "), rej[0]["detail"]
    assert "magic bytes" in job.rejects[("g_random.parquet", 1)]["detail"]
    assert "0 bytes" in job.rejects[("i_zero_bytes.parquet", 1)]["detail"]
    assert "BYTE_ARRAY" in job.rejects[("j_damaged.parquet", 3)]["detail"]
    assert {r["id"] for r in job.data if r["id"].startswith("dmg")} == {"dmg0", "dmg1"}


@pytest.mark.integration
def test_extra_columns_pass_through(job):
    row = next(r for r in job.data if r["id"] == "a-extra")
    assert (row["difficulty"], row["flag"], row["ratio"]) == (3, True, 0.25)
    assert json.loads(row["tags"]) == ["x", "y"] and json.loads(row["meta"]) == {"k": [1]}
    assert row["input_budget"] == "mine"  # named like an output column: prefixed, not lost
    assert row["topic"]


@pytest.mark.integration
def test_unicode_text_survives_unchanged(job):
    by_id = {r["id"]: r for r in job.data}
    for (name, _), e in job.fates.items():
        if e.case == "unicode" and isinstance(e.payload, dict):
            row = by_id[e.payload["id"]]
            assert (row["question"], row["cot"], row["answer"]) == (
                e.payload["question"], e.payload["cot"], e.payload["answer"])
    detail = job.rejects[("a.jsonl", next(i for i, e in enumerate(A, 1)
                                          if e.case == "lone_surrogate"))]["detail"]
    assert "question" in detail and "\\ud800" in detail


@pytest.mark.integration
def test_reject_details(job):
    deep = next(r for r in job.rejects.values() if r["detail"] == "nested too deeply")
    assert deep["reason"] == "invalid_json"
    utf8 = next(r for r in job.rejects.values() if r["reason"] == "invalid_utf8")
    assert "\\xe9" in utf8["raw"] or "\\xc0" in utf8["raw"]
    long = next(r for r in job.rejects.values() if r["id"] == "a-long")
    assert long["reason"] == "too_long" and "model context 256" in long["detail"]


@pytest.mark.integration
def test_rejects_keep_the_id_they_could_read_and_a_detail(job):
    """A row rejected for a bad field still names its id, and every reason says why."""
    assert job.rejects and all(r["detail"].strip() for r in job.rejects.values())
    checked = 0
    for key, e in job.fates.items():
        rej = job.rejects.get(key)
        if rej is None or not isinstance(e.payload, dict):
            continue
        id_ = e.payload.get("id")
        if isinstance(id_, int) and not isinstance(id_, bool):
            id_ = str(id_)
        if isinstance(id_, str) and id_.strip():
            assert rej["id"] == id_, f"{key} ({rej['reason']}): id {rej['id']!r}, not {id_!r}"
            checked += 1
    assert checked > 10


@pytest.mark.integration
def test_folder_of_empty_files_only(local_ray, model_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(b"")
    (corpus / "b.jsonl").write_bytes(b"\n\n")
    (corpus / "c.parquet").write_bytes(parquet([], schema=pa.schema([("question", pa.string())])))
    manifest = compress.run(config(corpus, tmp_path / "out", model_dir))
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"], c["already_done"]) == (0, 0, 0, 0)
    assert (tmp_path / "out" / "_manifest.json").exists()


@pytest.mark.integration
def test_corrupt_gzip_fails_the_job(local_ray, model_dir, tmp_path):
    """A corrupt gzip stream shows as OSError, as a storage failure does: it fails the run
    (no manifest, nothing lost silently) rather than becoming a reject."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(dumps(good(id="z0")) + b"\n")
    (corpus / "b.jsonl.gz").write_bytes(b"this is not gzip\n")
    with pytest.raises(Exception, match="zlib|gzip|inflate"):
        compress.run(config(corpus, tmp_path / "out", model_dir))
    assert not (tmp_path / "out" / "_manifest.json").exists()


def test_extra_integer_beyond_int64():
    value = 10**30
    type_ = kinds_type({value_kind(value)})
    t = pa.Table.from_pylist([{"big": extra_value(value, type_)}],
                             schema=pa.schema([("big", type_)]))
    assert t.column("big").to_pylist() == [str(value)]


# ------------------------------------------------------------------ property-based

POOL = demo_corpus(6, seed=21)
IDS = ["p0", "p1", "p2", None]  # None: the id is a hash of the texts
_extra_values = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1),
                          st.floats(), st.text(max_size=20), st.lists(st.integers(), max_size=3))
# (mutation, reason): each turns a valid row into an invalid one for a known reason.
MUTATIONS = {
    "missing_column": lambda r, t: {k: v for k, v in r.items() if k != "cot"} | {"q2": t},
    "question_not_string": lambda r, t: r | {"question": [t]},
    "cot_not_string": lambda r, t: r | {"cot": {"t": t}},
    "empty_answer": lambda r, t: r | {"answer": " " * (len(t) % 3)},
    "null_byte_in_cot": lambda r, t: r | {"cot": t + "\u0000" + t},
    "id_not_string": lambda r, t: r | {"id": bool(len(t) % 2)},
    "empty_id": lambda r, t: r | {"id": " " * (len(t) % 3)},
    "lone_surrogate": lambda r, t: r | {"question": t + "\udc80"},
}


@st.composite
def corpora(draw):
    rows = []
    for _ in range(draw(st.integers(1, 12))):
        base = dict(draw(st.sampled_from(POOL)))
        base["id"] = draw(st.sampled_from(IDS))
        extras = draw(st.dictionaries(st.sampled_from(["x_a", "x_b", "topic"]), _extra_values,
                                      max_size=2))
        base.update(extras)
        kind = draw(st.sampled_from(["valid", "valid", "garbage", *MUTATIONS]))
        if kind == "valid":
            rows.append(("ok", base))
        elif kind == "garbage":
            rows.append((None, b"#" + draw(st.binary(max_size=30)).replace(b"\n", b"")))
        else:
            text = draw(st.text(max_size=20))
            rows.append((kind, MUTATIONS[kind](base, text)))
    split = draw(st.integers(0, len(rows)))  # rows[split:] that fit go to parquet
    return rows, split


def _key(row: dict) -> str:
    return row["id"] if row.get("id") is not None else stable_id(
        row["question"], row["cot"], row["answer"])


@pytest.mark.integration
@settings(max_examples=6, deadline=None, database=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: each try is a run
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(corpus=corpora())
def test_property_every_row_has_one_fate(local_ray, model_dir, corpus):
    rows, split = corpus
    # Parquet holds the valid rows from `split` on (string columns only); the rest is JSONL.
    in_parquet = [i for i, (kind, r) in enumerate(rows)
                  if i >= split and kind == "ok"]
    jsonl_rows = [i for i in range(len(rows)) if i not in in_parquet]
    order = jsonl_rows + in_parquet  # a.jsonl sorts before b.parquet
    with tempfile.TemporaryDirectory() as tmp:
        corpus_dir = Path(tmp) / "corpus"
        corpus_dir.mkdir()
        lines = []
        for i in jsonl_rows:
            kind, r = rows[i]
            lines.append(r if isinstance(r, bytes) else json.dumps(r).encode())
        (corpus_dir / "a.jsonl").write_bytes(b"".join(x + b"\n" for x in lines))
        if in_parquet:
            records = [{k: rows[i][1].get(k) for k in ("id", "question", "cot", "answer")}
                       for i in in_parquet]
            (corpus_dir / "b.parquet").write_bytes(parquet(records))
        manifest = compress.run(config(corpus_dir, Path(tmp) / "out", model_dir))
        data = read_dir(Path(tmp) / "out", "data")
        rejects = read_dir(Path(tmp) / "out", "rejects")

    where = {}  # (file, row) -> index into rows
    for n, i in enumerate(jsonl_rows, 1):
        where[("a.jsonl", n)] = i
    for n, i in enumerate(in_parquet, 1):
        where[("b.parquet", n)] = i
    seen, want_scored, want_reason = set(), set(), {}
    for i in order:
        kind, r = rows[i]
        if kind == "ok":
            if _key(r) in seen:
                want_reason[i] = {"duplicate_id"}
            else:
                seen.add(_key(r))
                want_scored.add(_key(r))
        else:
            want_reason[i] = {kind} if kind else {"invalid_json", "invalid_utf8"}

    c = manifest["counts"]
    assert c["read"] == len(rows) == c["scored"] + c["rejected"] + c["already_done"]
    got = {}
    for r in rejects:
        key = (r["source"].rsplit("/", 1)[1], r["row"])
        assert key in where and where[key] not in got, f"{key} rejected twice or unknown"
        got[where[key]] = r["reason"]
    assert set(got) == set(want_reason)
    for i, reason in got.items():
        assert reason in want_reason[i], (rows[i], reason)
    pairs = Counter((r["id"], r["budget"]) for r in data)
    assert not pairs or max(pairs.values()) == 1
    assert {r["id"] for r in data} == want_scored
    assert c["written_per_budget"] == {str(b): len(want_scored) for b in BUDGETS}
