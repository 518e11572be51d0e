import numpy as np
import pytest
import torch

from mist_core import MissingDependency, get_scorer, scorer_names


def _full_forward(lm, ids, attentions=False):
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return lm.model(input_ids=torch.tensor(ids)[None], output_attentions=attentions)
    finally:
        lm.model.set_attn_implementation("sdpa")


def test_every_name_builds_a_scorer(tiny_lm):
    for name in scorer_names():
        if name == "llmlingua2":
            continue
        assert get_scorer(name, tiny_lm).method == name


def test_perplexity_is_self_information(tiny_lm, examples):
    scorer = get_scorer("perplexity", tiny_lm)
    for s in scorer.score(examples):
        logp = torch.log_softmax(_full_forward(tiny_lm, s.source_ids).logits[0], -1).numpy()
        want = [-logp[t - 1, s.source_ids[t]] for t in range(s.chain_start, s.chain_start + len(s.scores))]
        np.testing.assert_allclose(s.scores, want, rtol=1e-4)


def test_h2o_and_rollout_follow_their_definitions(tiny_lm, examples):
    h2o = get_scorer("h2o", tiny_lm).score(examples)
    roll = get_scorer("attention_rollout", tiny_lm).score(examples)
    for a, b in zip(h2o, roll):
        att = [x[0].double().numpy() for x in _full_forward(tiny_lm, a.source_ids, True).attentions]
        rows = list(range(a.answer_start - 1, a.answer_stop - 1))
        chain = slice(a.chain_start, a.chain_start + len(a.scores))
        want_h2o = sum(x[:, rows].sum((0, 1)) for x in att)[chain]
        np.testing.assert_allclose(a.scores, want_h2o, rtol=1e-5)
        n = att[0].shape[-1]
        A = np.eye(n)
        for x in att:  # A^(l) = (Ã^(l) + I) · A^(l-1), bottom up, the full matrices
            A = (x.mean(0) + np.eye(n)) @ A
        np.testing.assert_allclose(b.scores, A[rows].sum(0)[chain], rtol=1e-6)
    assert tiny_lm.model.config._attn_implementation == "sdpa"  # switched back


def test_crisp_reads_the_end_of_thinking_row(tiny_lm, examples):
    for s in get_scorer("crisp", tiny_lm).score(examples):
        att = [x[0].double().numpy() for x in _full_forward(tiny_lm, s.source_ids, True).attentions]
        end = s.chain_start + len(s.scores)  # the first token after the chain
        want = sum(x[:, end] for x in att).sum(0)[s.chain_start:end]
        np.testing.assert_allclose(s.scores, want, rtol=1e-5)


def test_gogi_is_the_l1_norm_of_the_gradient(tiny_lm, examples):
    [s] = get_scorer("gogi_l1", tiny_lm).score(examples[:1])
    L = tiny_lm.n_layers
    ids = torch.tensor(s.source_ids)[None]
    delta = torch.zeros(1, ids.shape[1], tiny_lm.model.config.hidden_size, requires_grad=True)
    hook = tiny_lm.blocks[L - 3].register_forward_hook(lambda m, a, o: o + delta)  # h^(L-2)
    try:
        with torch.enable_grad():
            logp = torch.log_softmax(tiny_lm.model(input_ids=ids).logits[0], -1)
            ll = sum(logp[t - 1, ids[0, t]] for t in range(s.answer_start, s.answer_stop))
            (g,) = torch.autograd.grad(ll, [delta])
    finally:
        hook.remove()
    want = g[0, s.chain_start:s.chain_start + len(s.scores)].abs().sum(-1).numpy()
    np.testing.assert_allclose(s.scores, want, rtol=1e-4)


def test_uniform_is_seeded(tiny_lm, examples):
    a = get_scorer("uniform", tiny_lm, seed=1).score(examples)
    b = get_scorer("uniform", tiny_lm, seed=1).score(examples[::-1])[::-1]
    c = get_scorer("uniform", tiny_lm, seed=2).score(examples)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(x.scores, y.scores)
        assert not np.array_equal(x.scores, z.scores)


def test_llmlingua2_fails_clearly_without_its_classifier(tiny_lm, tmp_path):
    with pytest.raises(MissingDependency, match="LLMLingua-2 classifier"):
        get_scorer("llmlingua2", tiny_lm, classifier=str(tmp_path / "absent"))


def test_llmlingua2_maps_classifier_probabilities_onto_chain_tokens(tiny_lm, tokenizer, examples, tmp_path):
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, num_labels=2)
    BertForTokenClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    scorer = get_scorer("llmlingua2", tiny_lm, classifier=str(tmp_path))
    [s] = scorer.score(examples[:1])
    enc = scorer.cls_tok(examples[0].cot, return_tensors="pt")
    with torch.no_grad():
        probs = torch.softmax(scorer.cls_model(**enc).logits[0], -1)[:, 1].numpy()
    # same tokenizer on both sides: each chain token overlaps exactly its own piece
    np.testing.assert_allclose(s.scores, probs, rtol=1e-5)
