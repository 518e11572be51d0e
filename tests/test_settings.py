"""One settings model for the job and the evaluation (pipelines/common/settings.py): each setting
declared once, the same from flags, YAML and Python, the parsers built from it."""
from __future__ import annotations

import pickle

import pytest

from pipelines.job import compress
from pipelines.evaluation import evaluate
from pipelines.common.settings import ConfigError, Settings, build_parser, from_mapping, validate
from pipelines.evaluation.config import EvalConfig
from pipelines.job.config import JobConfig


def _help(kind, prog="p") -> dict[str, str]:
    """flag -> its help text, from a settings class's parser."""
    p = build_parser(kind, prog, "")
    return {a.option_strings[0]: a.help for a in p._actions if a.option_strings}


def test_shared_settings_have_one_declaration():
    """A setting both commands take reads and checks the same way in both, unless a command
    declares it again on purpose (another default or meaning)."""
    job, ev = _help(JobConfig), _help(EvalConfig)
    redeclared = {"input", "budgets"}  # required in eval; other defaults
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert (job[flag] == ev[flag]) == (name not in redeclared), flag
    # every setting is a flag and every flag a setting
    for kind, flags in ((JobConfig, job), (EvalConfig, ev)):
        assert set(flags) - {"-h", "--config"} == {"--" + n.replace("_", "-")
                                                    for n in kind.model_fields}


def test_the_help_shows_each_declared_default():
    job = _help(JobConfig)
    assert job["--batch-size"].endswith("(default: 32)")
    assert job["--budgets"].endswith("(default: 0.5,0.6,0.7,0.8,0.9)")
    assert "(default:" not in job["--scores"]  # a switch, off unless given
    assert _help(EvalConfig)["--input"].endswith("(required)")


@pytest.mark.parametrize("argv, message", [
    (["--input", "x", "--alpha", "2"], "alpha must lie in \\[0, 1\\]"),
    (["--input", "x", "--sample", "0"], "sample must be at least 1"),
    (["--input", "x", "--methods", "mist,magic"], "unknown methods \\['magic'\\]"),
    (["--input", "x", "--budgets", "0"], "budgets must lie in"),
    (["--input", "x", "--batch-size", "many"], "batch_size: Input should be a valid integer"),
    ([], "input is required"),
])
def test_evaluation_settings_are_checked_like_the_job(argv, message):
    with pytest.raises(ConfigError, match=message):
        evaluate.parse_args(argv, "mist eval")


def test_yaml_flags_and_python_agree(tmp_path):
    (tmp_path / "eval.yaml").write_text("input: [a.jsonl]\nadapter: gsm8k\nbudgets: [0.7, 0.3]\n"
                                        "exact-layers: 2,4\nactors: 1,2\n")
    from_yaml = evaluate.parse_args(["--config", str(tmp_path / "eval.yaml"), "--sample", "5"],
                                    "mist eval")
    from_flags = evaluate.parse_args(["--input", "a.jsonl", "--adapter", "gsm8k", "--budgets",
                                      "0.3,0.7", "--exact-layers", "2,4", "--actors", "1,2",
                                      "--sample", "5"], "mist eval")
    from_python = EvalConfig(input=["a.jsonl"], adapter="gsm8k", budgets=[0.3, 0.7],
                             exact_layers=[2, 4], actors=(1, 2), sample=5)
    assert from_yaml == from_flags == from_python
    assert from_python.budgets == [0.3, 0.7] and from_python.gpus_per_actor is None
    job = compress.parse_args(["--input", "a.jsonl", "--gpus-per-actor", "auto",
                               "--max-memory", "1GB", "--sft-format", "chat"])
    assert job == JobConfig(input=["a.jsonl"], max_memory=2**30, sft_format="messages")
    # a switch on by default is turned off by --no-<flag>, and stays on without it
    assert job.facts_first and not compress.parse_args(["--no-facts-first"]).facts_first
    assert compress.parse_args(["--facts-first", "--keep-digits"]).facts_first


def test_settings_are_frozen_whole_values():
    cfg = JobConfig(budgets="0.9,0.5,0.9")
    assert cfg.budgets == [0.5, 0.9]  # sorted, once each
    with pytest.raises(Exception):
        cfg.batch_size = 1  # a stage gets the settings whole and cannot change them
    assert validate(cfg) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg  # Ray ships them
    assert from_mapping({"batch-size": 8}, cfg).batch_size == 8
    assert cfg.to_dict()["actors"] == [1, 1]  # JSON values, for manifests
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        JobConfig(bogus=1)


def test_layer_weights_are_the_scorers_and_mist_only():
    from mist_core.scoring.choices import LAYER_WEIGHTS

    assert JobConfig.model_fields["layer_weights"].json_schema_extra["choices"] == LAYER_WEIGHTS
    assert JobConfig().layer_weights == "clipped"  # the project's default, not the paper's
    assert JobConfig(method="necessity", layer_weights="signed").layer_weights == "signed"
    assert JobConfig(method="h2o").method == "h2o"
    with pytest.raises(ConfigError, match="layer_weights is MIST's"):
        JobConfig(method="h2o", layer_weights="signed")


def test_the_necessity_target_is_mist_and_necessity_only():
    from mist_core.scoring.choices import TARGETS

    assert JobConfig.model_fields["target"].json_schema_extra["choices"] == TARGETS
    assert JobConfig(target="both").scoring().target == "both"  # mist takes it
    assert JobConfig(method="necessity", target="facts").scoring().target == "facts"
    assert "target" not in JobConfig(method="sufficiency").scoring().options()
    for method in ("sufficiency", "h2o"):
        with pytest.raises(ConfigError, match="target is MIST's"):
            JobConfig(method=method, target="answer")


def test_the_scoring_actor_builds_the_scorer_the_settings_name(model_dir):
    from pipelines.job import stages

    for method, weights in (("mist", "clipped"), ("sufficiency", "clipped"), ("mist", "signed")):
        actor = stages.ScoreActor(JobConfig(model=str(model_dir), method=method,
                                            layer_weights=weights, alpha=0.3), device="cpu")
        assert (actor.scorer.method, actor.scorer.layer_weights) == (method, weights)
    assert actor.scorer.alpha == 0.3


def test_a_refresh_keeps_the_layer_weights_of_the_output():
    """Rows scored with other layer weights (or pruned otherwise) are not mixed into an
    output; an output from before a setting holds what was done before it."""
    from types import SimpleNamespace

    from pipelines.job.compress import check_compatible

    out = SimpleNamespace(display=lambda: "outputs/x")

    def existing(config):
        return SimpleNamespace(methods={"mist"}, models={"m"}, budgets={0.5},
                               manifest={"config": config})

    current = {"layer_weights": "clipped", "facts_first": True, "target": "both",
               "sentences_first": "equations"}  # the defaults
    clipped = JobConfig(budgets=[0.5])
    with pytest.raises(ConfigError, match="layer_weights 'signed' vs 'clipped'"):
        check_compatible(clipped, "m", existing({"unit": "word"}), out)
    check_compatible(clipped, "m", existing(current), out)
    check_compatible(JobConfig(budgets=[0.5], layer_weights="signed", facts_first=False,
                               target="answer", sentences_first="none"), "m",
                     existing({"unit": "word"}), out)
    h2o = SimpleNamespace(methods={"h2o"}, models={"m"}, budgets={0.5},
                          manifest={"config": {"layer_weights": "signed", "facts_first": True,
                                               "sentences_first": "equations"}})
    check_compatible(JobConfig(budgets=[0.5], method="h2o"), "m", h2o, out)  # not h2o's setting
    empty = SimpleNamespace(methods=set(), models=set(), budgets=set(), manifest=None)
    check_compatible(clipped, "m", empty, out)  # a new output takes any
    # An output from before facts_first ranked every unit by score: facts_first off.
    facts = JobConfig(budgets=[0.5])
    assert facts.facts_first
    with pytest.raises(ConfigError, match="facts_first False vs True"):
        check_compatible(facts, "m", existing({**current, "facts_first": False}), out)
    with pytest.raises(ConfigError, match="facts_first False vs True"):
        check_compatible(facts, "m", existing({"layer_weights": "clipped", "target": "both"}),
                         out)
    check_compatible(facts, "m", existing(current), out)
    check_compatible(facts, "m", empty, out)
    # An output from before the target setting differentiated the answer alone.
    before = {"layer_weights": "clipped", "facts_first": True}
    assert clipped.target == "both"
    with pytest.raises(ConfigError, match="target 'answer' vs 'both'"):
        check_compatible(clipped, "m", existing(before), out)
    check_compatible(JobConfig(budgets=[0.5], target="answer", sentences_first="none"), "m",
                     existing(before), out)
    # An output from before sentences_first ranked every unit on its own: none.
    sentences = JobConfig(budgets=[0.5])
    assert sentences.sentences_first == "equations"
    unset = {k: v for k, v in current.items() if k != "sentences_first"}
    for old in (unset, {**unset, "sentences_first": None}):
        with pytest.raises(ConfigError, match="sentences_first 'none' vs 'equations'"):
            check_compatible(sentences, "m", existing(old), out)
        check_compatible(JobConfig(budgets=[0.5], sentences_first="none"), "m", existing(old),
                         out)
    check_compatible(sentences, "m", existing(current), out)
    with pytest.raises(ConfigError, match="sentences_first 'equations' vs 'facts'"):
        check_compatible(JobConfig(budgets=[0.5], sentences_first="facts"), "m",
                         existing(current), out)
    with pytest.raises(ConfigError, match="sentences_first must be one of equations, facts, none"):
        JobConfig(budgets=[0.5], sentences_first="words")


def test_one_builder_makes_every_registered_scorer(tiny_lm):
    """mist_core.scoring.registry.Scoring builds each registered method, from Python and from the
    job's settings (JobConfig.scoring), with the options that method takes and no other."""
    from mist_core import MissingDependency, scorer_names
    from mist_core.scoring.registry import Scoring

    built = 0
    for name in scorer_names():
        for scoring in (Scoring(name, max_memory=None),
                        JobConfig(method=name, batch_tokens=512, batch_size=4).scoring()):
            try:
                scorer = scoring.scorer(tiny_lm)
            except MissingDependency:  # llmlingua2's classifier is not on this machine
                continue
            assert scorer.method == name and scorer.max_batch == scoring.max_batch
            built += 1
    assert built >= 2 * (len(scorer_names()) - 1)
    mist = JobConfig(alpha=0.3, layer_weights="signed", target="both").scoring().scorer(tiny_lm)
    assert (mist.alpha, mist.layer_weights, mist.target) == (0.3, "signed", "both")
    assert "alpha" not in JobConfig(method="sufficiency", alpha=0.3).scoring().options()
    with pytest.raises(ValueError, match="alpha is not an option of h2o"):
        Scoring("h2o", alpha=0.3)
    with pytest.raises(ValueError, match="unknown method"):
        Scoring("nope")


def _settings_class(module):
    from pipelines.common import settings

    kits = {v for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, settings.Kit)
            and v.__module__.startswith("pipelines.") and v.__module__ != settings.__name__}
    own = [k for k in kits if not any(o is not k and issubclass(o, k) for o in kits)]
    return own[0] if len(own) == 1 else None


def test_every_command_help_comes_from_its_settings(capsys):
    """`mist <command> --help` lists each declared setting as its flag (or positional)
    with its help text, and nothing the settings do not declare."""
    import importlib

    from pipelines import cli

    checked = set()
    for command, (module, _) in cli.COMMANDS.items():
        kind = _settings_class(importlib.import_module(f"pipelines.{module}"))
        assert kind is not None, f"mist {command} declares no settings class"
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        parser = build_parser(kind, f"mist {command}", "")
        for name, info in kind.model_fields.items():
            flag = next(a for a in parser._actions if a.dest == name)
            shown = flag.option_strings[0] if flag.option_strings else flag.metavar
            assert shown in text, (command, name)
            assert " ".join((info.description or "").split())[:40] in text, (command, name)
        dests = {a.dest for a in parser._actions} - {"help", "config"}
        assert dests == set(kind.model_fields), command
        checked.add(command)
    assert checked == set(cli.COMMANDS)


def test_the_prune_stage_prunes_as_the_settings_say():
    """The job's prune stage passes unit, facts_first and sentences_first to the pruning: its
    chains are prune_scores' with the same settings (a filler sentence goes whole by default
    and with --sentences-first facts, and is cut into with none)."""
    import numpy as np
    import pyarrow as pa

    from mist_core import Example
    from mist_core.scoring.prune import prune_scores
    from pipelines.job.stages import OK, STREAM_SCHEMA, prune_batch

    cot = "Ann has 3 apples. The apples are red and very nice. She buys 4, so 3 + 4 = 7."
    offsets = np.array([m.span() for m in __import__("re").finditer(r"\s*\S+", cot)])
    words = [cot[a:b].strip() for a, b in offsets]
    # the filler sentence low but for its last word, the highest of the chain
    scores = np.array([3.0 if w == "nice." else -1.0 if 4 <= i < 11 else 0.5
                       for i, w in enumerate(words)])
    row = {"input": 0, "source": "s", "row": 0, "status": OK, "id": "a", "question": "q?",
           "cot": cot, "answer": "7", "scores": scores.tolist(),
           "chain_offsets": offsets.reshape(-1).tolist()}
    ex = Example("q?", cot, "7", id="a")
    for kw in ({"sentences_first": "none"}, {}, {"sentences_first": "facts"},
               {"sentences_first": "facts", "unit": "token"}):
        cfg = JobConfig(budgets=[0.5, 0.8], **kw)
        out = prune_batch(pa.Table.from_pylist([row], schema=STREAM_SCHEMA), cfg=cfg).to_pylist()[0]
        want = prune_scores(ex, scores, offsets, [0.5, 0.8], cfg.unit, cfg.keep_digits,
                            cfg.facts_first, sentences_first=cfg.sentence_rule)
        assert out["compressed"] == [c.text for c in want]
        assert out["kept_tokens"] == [c.kept_tokens for c in want]
        assert ("nice." in out["compressed"][0]) == (cfg.sentences_first == "none")
