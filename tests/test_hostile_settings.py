"""Hostile settings: a config file or flag value of any shape is either valid settings or one
ConfigError line (exit status 2), never a traceback, a prompt or a runaway message. The YAML
side refuses aliases (a `billion laughs` file would otherwise expand in the error message)
and anything but a bounded UTF-8 mapping."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from pipelines.job import compress
from pipelines.common.settings import ConfigError, MAX_CONFIG_BYTES, from_mapping, load_yaml
from pipelines.evaluation.config import EvalConfig
from pipelines.job.config import JobConfig

MAX_MESSAGE = 600  # a message names the setting and a shortened value: a line, not a dump


def _bomb(key: str, depth: int = 9) -> str:
    """The YAML 'billion laughs' under one setting: a list of anchors, each a list of nine
    aliases of the one before, so that the last stands for 9**(depth-1) strings."""
    items = ['&a0 ["lol"]'] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, depth)]
    return f"{key}:\n" + "".join(f"  - {item}\n" for item in items)


def _one_line(e: ConfigError) -> str:
    text = str(e)
    assert "\n" not in text and 0 < len(text) <= MAX_MESSAGE, text[:2000]
    return text


def _parse_file(tmp_path, body: bytes | str, *flags):
    path = tmp_path / "c.yaml"
    path.write_bytes(body.encode() if isinstance(body, str) else body)
    return compress.parse_args(["--config", str(path), *flags])


@pytest.mark.parametrize("key", ["budgets", "input", "columns", "model"])
@pytest.mark.parametrize("depth", [3, 9])
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, key, depth):
    with pytest.raises(ConfigError) as e:
        _parse_file(tmp_path, _bomb(key, depth))
    assert "alias" in _one_line(e.value)


def test_an_alias_is_refused_even_a_small_one(tmp_path):
    with pytest.raises(ConfigError, match="alias"):
        _parse_file(tmp_path, "x: &b [0.5]\nbudgets: *b\n")
    with pytest.raises(ConfigError, match="alias"):  # a merge key is an alias too
        _parse_file(tmp_path, "base: &b {alpha: 0.5}\n<<: *b\n")


@pytest.mark.parametrize("body, message", [
    ("input: 5\n", "input"),
    ("input: [[a, b]]\n", "input"),
    ("input: {a: 1}\n", "input"),
    ("budgets: 5\n", "budgets"),
    ("budgets: {a: 1}\n", "budgets"),
    ("actors: 1.5\n", "actors"),
    ("actors: [[1]]\n", "actors"),
    ("gpus_per_actor: [1]\n", "gpus_per_actor"),
    ("batch_tokens: [1]\n", "batch_tokens"),
    ("max_memory: [1]\n", "max_memory"),
    ("columns: [1, 2]\n", "columns"),
    ("columns: {question: [1]}\n", "columns"),
    ("model: [1, 2]\n", "model"),
    ("1: x\n", "unknown setting 1"),
    ("~: x\n", "unknown setting None"),
    ("[a]: x\n", "not valid YAML"),  # a key YAML itself cannot hash
    ("budgets: 0.5\nlimit: " + "9" * 5000 + "\n", "not valid YAML"),  # past int's digit limit
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML"),  # nested past the recursion limit
    ("a: 1\n\tb: 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "mapping"),
])
def test_a_bad_config_value_is_one_line(tmp_path, body, message):
    with pytest.raises(ConfigError) as e:
        _parse_file(tmp_path, body)
    assert message in _one_line(e.value)


def test_a_non_utf8_config_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        _parse_file(tmp_path, b"model: caf\xe9\n")
    assert "UTF-8" in _one_line(e.value)


def test_an_oversized_config_file_is_refused_unread(tmp_path):
    with pytest.raises(ConfigError) as e:
        _parse_file(tmp_path, "model: " + "x" * (MAX_CONFIG_BYTES + 10) + "\n")
    assert "larger than" in _one_line(e.value)


def test_a_long_value_is_shortened_in_the_message(tmp_path):
    with pytest.raises(ConfigError) as e:
        _parse_file(tmp_path, "budgets: [" + ", ".join(["x" * 1000] * 200) + "]\n")
    assert "budgets" in _one_line(e.value)
    with pytest.raises(ConfigError) as e:
        from_mapping({"template": "t" * 100_000}, kind=JobConfig)
    assert "template must be one of" in _one_line(e.value)
    with pytest.raises(ConfigError) as e:
        from_mapping({"k" * 100_000: 1}, kind=JobConfig)
    assert "unknown setting" in _one_line(e.value)


@pytest.mark.parametrize("values", [{"model": 10**5000}, {"budgets": 10**5000},
                                    {"actors": 10**5000}, {"max_memory": 10**5000},
                                    {10**5000: 1}, {"seed": float("nan")}])
def test_an_int_with_no_repr_is_one_line(values):
    """Past int()'s digit limit a number has no repr: a message may not need one (a huge
    number of actors is valid as settings; the cluster refuses it later)."""
    _settings_or_one_line(lambda: from_mapping(values, kind=JobConfig))


def test_a_good_config_still_reads(tmp_path):
    cfg = _parse_file(tmp_path, "input: [a.jsonl, 2024]\nbudgets: [0.7, 0.5]\nactors: 1,2\n"
                                "columns: {question: q}\nbatch-size: 4\n")
    assert cfg.input == ["a.jsonl", "2024"] and cfg.budgets == [0.5, 0.7]
    assert cfg.actors == (1, 2) and cfg.columns == {"question": "q"} and cfg.batch_size == 4


# ------------------------------------------------------------------ property-based

NAMES = sorted(set(JobConfig.model_fields) | set(EvalConfig.model_fields))
_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-10, 10),
                     st.floats(), st.sampled_from([0.5, 1.0, "0.5,0.7", "auto", "1,2", "6GB",
                                                   "question=q", "demo", "gsm8k", "mist"]),
                     st.text(max_size=30), st.binary(max_size=10))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=12)
_keys = st.one_of(st.sampled_from(NAMES), st.sampled_from([n.replace("_", "-") for n in NAMES]),
                  st.text(max_size=12), st.integers(), st.none())
_mappings = st.dictionaries(_keys, _values, max_size=5)


def _settings_or_one_line(make):
    try:
        cfg = make()
    except ConfigError as e:
        _one_line(e)
        return None
    assert isinstance(cfg, (JobConfig, EvalConfig))
    return cfg


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(values=_mappings, kind=st.sampled_from([JobConfig, EvalConfig]))
def test_property_any_mapping_is_settings_or_one_line(values, kind):
    cfg = _settings_or_one_line(lambda: from_mapping(values, kind=kind))
    if cfg is not None:
        assert all(0 < b <= 1 for b in cfg.budgets) and not math.isnan(cfg.alpha)


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.one_of(
    _mappings.map(lambda m: yaml.safe_dump(m, allow_unicode=True, sort_keys=False).encode("utf-8", "replace")),
    st.binary(max_size=200),
    st.text(alphabet=st.sampled_from(list("ab:-[]{},&*!|>#'\"\n\t 0.5~<")), max_size=60)
    .map(str.encode)))
def test_property_any_config_file_is_settings_or_one_line(doc):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_bytes(doc)
        _settings_or_one_line(lambda: compress.parse_args(["--config", str(path)]))
        try:
            load_yaml(str(path))
        except ConfigError as e:
            _one_line(e)


# ------------------------------------------------------------------ mist train's settings

def _mist(*argv) -> int:
    from pipelines.cli import main

    return main([str(a) for a in argv])


def _sft_file(tmp_path) -> Path:
    from mist_core.data.formats import sft_prompt_completion

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(sft_prompt_completion(
        id="a", question="What is 2 + 2?", cot="2 + 2 = 4.", answer="4", budget=1.0)) + "\n")
    return path


@pytest.mark.parametrize("line", [
    {"question": "q", "cot": "c", "answer": "1"},  # a corpus, not its compression output
    {"prompt": [{"role": "user"}], "completion": "x"},
    {"prompt": ["hi"], "completion": "x"},
    {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
    {"instruction": 5, "output": "x"},
    [1, 2],
    7,
])
def test_train_on_records_that_are_not_sft_is_one_line_before_the_model(tmp_path, capsys,
                                                                        monkeypatch, line):
    from pipelines.loop import base as loop

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the records were checked")

    monkeypatch.setattr(loop, "check_model", no_model)
    sft = _sft_file(tmp_path)
    sft.write_text(sft.read_text() + json.dumps(line) + "\n")
    assert _mist("train", "--sft", sft, "--output", tmp_path / "t") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "record 2" in err[0], err


def test_train_refuses_an_earlier_model_unless_asked_to_overwrite(tmp_path, capsys, monkeypatch):
    from mist_core.distill import finetune as F
    from pipelines.loop import base as loop

    trained = []

    def fake_finetune(model, records, out, **options):  # what finetune leaves in its folder
        out = Path(out)
        (out / "model.safetensors").write_text(f"weights {len(trained)}")
        (out / F.REPORT).write_text(json.dumps({"records": len(records), "steps": 1,
                                                "train_loss": 0.5, "losses": []}))
        trained.append(options["trust_remote_code"])
        return out

    monkeypatch.setattr(loop, "check_model", lambda model, trust=False: "m")
    monkeypatch.setattr(F, "finetune", fake_finetune)
    sft, out = _sft_file(tmp_path), tmp_path / "model"
    assert _mist("train", "--sft", sft, "--output", out) == 0
    assert (out / "model.safetensors").read_text() == "weights 0"
    capsys.readouterr()
    assert _mist("train", "--sft", sft, "--output", out) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and err.count("\n") == 1
    assert (out / "model.safetensors").read_text() == "weights 0" and len(trained) == 1
    (out / "stale.bin").write_text("from the earlier model")
    assert _mist("train", "--sft", sft, "--output", out, "--overwrite") == 0
    assert (out / "model.safetensors").read_text() == "weights 1"
    assert not (out / "stale.bin").exists()  # the earlier model replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "sft.jsonl"]  # no staging
    assert json.loads((out / F.REPORT).read_text())["workers"] == 1
    assert trained == [False, False]


def test_a_failed_training_leaves_the_earlier_model(tmp_path, monkeypatch):
    from mist_core.distill import finetune as F
    from pipelines.loop import base as loop

    def broken(model, records, out, **options):
        (Path(out) / "model.safetensors").write_text("half")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop, "check_model", lambda model, trust=False: "m")
    monkeypatch.setattr(F, "finetune", broken)
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_text("earlier")
    (out / F.REPORT).write_text("{}")
    with pytest.raises(RuntimeError):
        _mist("train", "--sft", _sft_file(tmp_path), "--output", out, "--overwrite")
    assert (out / "model.safetensors").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "sft.jsonl"]
