"""Decoding with a (fine-tuned) model, for the distillation loop: sampling chains to compress
(`mist generate`) and solving a test set under each budget γ (`mist solve`).

The prompt is the user turn exactly as the compression job's SFT records hold it (the
question, plus the directive below γ = 1.0), rendered by the tokenizer's chat template with
the generation prompt: what TRL feeds the model in training (`mist train`), so a model is
asked the way it was taught. A tokenizer without a chat template gets a plain prompt that
`finetune` builds identically.

Sampling is seeded per row, not per batch: every (prompt, sample) draws its noise from its
own generator (the Gumbel-max trick: the argmax of the warped logits plus Gumbel noise is a
sample from their softmax), so a row's samples do not depend on which rows share its batch
or actor. No Ray here."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..data.examples import last_boxed
from ..data.formats import sft_turns
from ..data.templates import ANSWER_LEAD
from ..measures.answers import answer_correct
from ..models import LM


# ---------------------------------------------------------------- prompts

def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def user_turn(question: str, budget: float = 1.0) -> str:
    """The user turn of the SFT records (formats.sft_turns): the question, and below
    γ = 1.0 the directive to reduce the chain."""
    return sft_turns(question=question, cot="", answer="", budget=budget)[0]


def plain_prompt(user: str) -> str:
    """The prompt for a tokenizer without a chat template (the job's plain template's
    framing); finetune trains on exactly this text before the completion."""
    return f"Question: {user}\nSolution:\n"


def render_prompt(tokenizer, user: str) -> str:
    """The text before the model's answer: the chat template with the generation prompt,
    else plain_prompt."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                             tokenize=False, add_generation_prompt=True)
    return plain_prompt(user)


def prompt_text(lm: LM, question: str, budget: float = 1.0) -> str:
    """The prompt that asks `question` under budget γ, as `mist train` trained on it."""
    return render_prompt(lm.tokenizer, user_turn(question, budget))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt. A rendered chat template carries its own special tokens (TRL
    tokenizes it with add_special_tokens=False); the plain prompt gets the tokenizer's
    (a BOS), as TRL tokenizes a plain-text prompt."""
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]


def split_completion(text: str) -> tuple[str, str | None]:
    """(chain, answer) of a completion, split at the last `The answer is `; the answer is
    None when the completion never states one (the chain is then the whole text)."""
    at = text.rfind(ANSWER_LEAD)
    if at < 0:
        return text.strip(), None
    return text[:at].strip(), text[at + len(ANSWER_LEAD):].strip()


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# A closing line that only states the answer in another wording: "#### 48" (GSM8K's),
# "The answer is: 48", "Final answer: 48".
_ANSWER_STATEMENT = re.compile(r"^\W*(?:####|(?:the\s+)?(?:final\s+)?answer\b)", re.I)


def read_answer(text: str, style: str) -> tuple[str, str | None, bool]:
    """(chain, stated answer, whether it came from a `The answer is ` line). A model not yet
    trained on that line (SmolLM2-135M-Instruct ends with "#### 48" or "The answer is: 48")
    is read as GSM8K and MATH are usually scored: its last number (gsm8k) or last \\boxed{}
    (math), the chain then without its closing answer statements. None: no answer at all."""
    chain, answer = split_completion(text)
    if answer is not None:
        return chain, answer, True
    if style == "math":
        answer = last_boxed(text)
    else:
        numbers = _NUMBER.findall(text)
        answer = numbers[-1].rstrip(",") if numbers else None
    if answer is None:
        return text.strip(), None, False
    lines = text.rstrip().split("\n")
    while len(lines) > 1 and _ANSWER_STATEMENT.match(lines[-1]):
        lines.pop()
    return "\n".join(lines).strip(), answer, False


# ---------------------------------------------------------------- decoding

@dataclass
class Completion:
    text: str  # decoded, special tokens and the end-of-sequence token left out
    tokens: int  # tokens generated, the end-of-sequence token not counted
    finished: bool  # stopped on end-of-sequence before max_new_tokens


def row_seed(seed: int, prompt: str, sample: int) -> int:
    h = hashlib.sha256(f"{seed}|{sample}|{prompt}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class _GumbelNoise:
    """A logits processor that adds Gumbel noise drawn from one generator per batch row;
    greedy decoding of the result samples from the (already warped) distribution."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        noise = torch.stack([torch.rand(scores.shape[-1], generator=g, device=g.device,
                                        dtype=torch.float32) for g in self.generators])
        noise = noise.clamp_(min=1e-20, max=1 - 1e-7).log_().neg_().log_().neg_()
        return scores.float() + noise.to(scores.device)


def _eos_ids(lm: LM) -> list[int]:
    """Every token that ends a completion: the tokenizer's end-of-sequence token and the
    model's generation config's (ChatML models end a turn with <|im_end|>)."""
    ids = set()
    tok = getattr(lm.tokenizer, "eos_token_id", None)
    if tok is not None:
        ids.add(int(tok))
    cfg = getattr(lm.model, "generation_config", None)
    extra = getattr(cfg, "eos_token_id", None) if cfg is not None else None
    if extra is not None:
        ids.update(int(x) for x in (extra if isinstance(extra, (list, tuple)) else [extra]))
    return sorted(ids)


@torch.no_grad()
def generate(lm: LM, prompts: list[str], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, num_samples: int = 1, seed: int = 0,
             batch_size: int = 8) -> list[list[Completion]]:
    """`num_samples` completions of each prompt (greedy when temperature == 0, where every
    sample is the same and is decoded once). transformers' `generate`, left-padded batches
    of prompts of similar length. Deterministic for a seed: a sample's noise comes from a
    generator seeded by (seed, prompt, sample index)."""
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation import TemperatureLogitsWarper, TopPLogitsWarper

    if max_new_tokens < 1 or num_samples < 1 or batch_size < 1:
        raise ValueError("max_new_tokens, num_samples and batch_size must be at least 1")
    greedy = temperature <= 0
    eos = _eos_ids(lm)
    if not eos:
        raise ValueError("the tokenizer has no end-of-sequence token: completions could not stop")
    encoded = [encode_prompt(lm.tokenizer, p) for p in prompts]
    # (prompt, sample) jobs, shortest prompt first: a batch pads to its longest prompt.
    jobs = [(i, s) for i in range(len(prompts)) for s in range(1 if greedy else num_samples)]
    jobs.sort(key=lambda j: (len(encoded[j[0]]), j))
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=eos, pad_token_id=lm.pad_id)
    results: dict[tuple[int, int], Completion] = {}
    was_training = lm.model.training
    lm.model.eval()
    try:
        for start in range(0, len(jobs), batch_size):
            batch = jobs[start: start + batch_size]
            width = max(len(encoded[i]) for i, _ in batch)
            ids = torch.full((len(batch), width), lm.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (i, _) in enumerate(batch):  # left padding: every prompt ends at `width`
                ids[r, width - len(encoded[i]):] = torch.tensor(encoded[i])
                mask[r, width - len(encoded[i]):] = 1
            processors = LogitsProcessorList()
            if not greedy:
                if temperature != 1.0:
                    processors.append(TemperatureLogitsWarper(temperature))
                if top_p < 1.0:
                    processors.append(TopPLogitsWarper(top_p))
                gens = []
                for i, s in batch:
                    g = torch.Generator(device=lm.device)
                    g.manual_seed(row_seed(seed, prompts[i], s))
                    gens.append(g)
                processors.append(_GumbelNoise(gens))
            out = lm.model.generate(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device),
                                    generation_config=config, logits_processor=processors)
            new = out[:, width:].cpu().tolist()
            for (i, s), toks in zip(batch, new):
                stop = next((n for n, t in enumerate(toks) if t in eos), None)
                body = toks if stop is None else toks[:stop]
                results[(i, s)] = Completion(
                    text=lm.tokenizer.decode(body, skip_special_tokens=True),
                    tokens=len(body), finished=stop is not None)
    finally:
        lm.model.train(was_training)
    return [[results[(i, 0 if greedy else s)] for s in range(num_samples)]
            for i in range(len(prompts))]


# ---------------------------------------------------------------- the loop's two uses

def sample_chains(lm: LM, rows: list[dict], *, k: int, style: str, temperature: float = 0.7,
                  top_p: float = 0.95, max_new_tokens: int = 512, seed: int = 0,
                  batch_size: int = 8) -> list[dict]:
    """k sampled completions per row (`id`, `question`, `answer` the gold answer), asked at
    γ = 1.0. One dict per sample, in the compression job's generic columns (`id`,
    `question`, `cot`, `answer` the gold answer) plus `source_id`, `sample`, `prediction`
    (read_answer: after the last `The answer is `, else the last number or \\boxed{}; None
    without any), `answer_line` (it was after `The answer is `), `correct`, `tokens`,
    `finished`. The caller keeps the correct ones."""
    prompts = [prompt_text(lm, r["question"]) for r in rows]
    done = generate(lm, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_p=top_p, num_samples=k, seed=seed, batch_size=batch_size)
    return [sample_record(row, i, c, style) for row, samples in zip(rows, done)
            for i, c in enumerate(samples)]


def sample_record(row: dict, sample: int, c: Completion, style: str) -> dict:
    """One sampled completion of a question row, judged (see sample_chains)."""
    chain, pred, line = read_answer(c.text, style)
    return {"id": f"{row['id']}#{sample}", "source_id": str(row["id"]), "sample": sample,
            "question": row["question"], "cot": chain, "answer": str(row["answer"]),
            "prediction": pred, "answer_line": line,
            "correct": pred is not None and answer_correct(pred, str(row["answer"]), style),
            "tokens": c.tokens, "finished": c.finished}


def shortest_per_question(samples: Sequence[dict]) -> dict[str, dict]:
    """{question id (`source_id`): its sample of fewest `tokens`, the first among equals in
    the order given}: the usual length baseline's choice (shortest-of-k)."""
    best: dict[str, dict] = {}
    for s in samples:
        if s["source_id"] not in best or s["tokens"] < best[s["source_id"]]["tokens"]:
            best[s["source_id"]] = s
    return best


def chain_tokens(lm: LM, chain: str) -> int:
    """The tokens of a chain's text, counted as the compression job counts a chain's."""
    return len(lm.tokenizer(chain, add_special_tokens=False)["input_ids"]) if chain else 0


def solve(lm: LM, rows: list[dict], *, budget: float, style: str, max_new_tokens: int = 512,
          batch_size: int = 8) -> list[dict]:
    """Greedy answers to each row (`id`, `question`, `answer` the gold answer) asked under
    budget γ. Per row: `id`, `budget`, `prediction` (read_answer; None without any answer),
    `answer_line`, `correct`, `chain_tokens` (the chain before the answer; every generated
    token where there is no answer), `tokens` (all generated), `finished`, `completion`."""
    prompts = [prompt_text(lm, r["question"], budget) for r in rows]
    done = generate(lm, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    out = []
    for row, (c,) in zip(rows, done):
        chain, pred, line = read_answer(c.text, style)
        out.append({"id": str(row["id"]), "budget": float(budget), "prediction": pred,
                    "answer_line": line,
                    "correct": pred is not None and answer_correct(pred, str(row["answer"]), style),
                    "chain_tokens": chain_tokens(lm, chain) if pred is not None else c.tokens,
                    "tokens": c.tokens, "finished": c.finished, "completion": c.text})
    return out


def summarize(solved: Sequence[dict], *, n_boot: int = 2000, seed: int = 0) -> list[dict]:
    """Per budget, in order: n, accuracy and mean chain tokens with 95% bootstrap intervals,
    the shares finished and answered on a `The answer is ` line, and the achieved compression (mean chain tokens at γ ÷ at γ = 1.0,
    over the ids answered at both, with a paired bootstrap interval: the same draws of ids
    for both means) beside the requested γ. Compression is None without γ = 1.0 results."""
    from ..measures.stats import bootstrap_indices, ci_mean, ci_ratio

    by_budget: dict[float, dict[str, dict]] = {}
    for r in solved:
        by_budget.setdefault(float(r["budget"]), {})[str(r["id"])] = r
    full = by_budget.get(1.0)
    out = []
    for budget in sorted(by_budget):
        rows = by_budget[budget]
        ids = sorted(rows)
        idx = bootstrap_indices(len(ids), n_boot, seed)
        acc = ci_mean(np.array([float(rows[i]["correct"]) for i in ids]), idx)
        toks = ci_mean(np.array([float(rows[i]["chain_tokens"]) for i in ids]), idx)
        entry = {"budget": budget, "n": len(ids),
                 "accuracy": acc[0], "accuracy_ci": [acc[1], acc[2]],
                 "chain_tokens": toks[0], "chain_tokens_ci": [toks[1], toks[2]],
                 "finished": float(np.mean([bool(rows[i]["finished"]) for i in ids])),
                 "answer_line": float(np.mean([bool(rows[i].get("answer_line", True))
                                               for i in ids])),
                 "requested_compression": budget, "compression": None,
                 "compression_ci": None, "paired_n": 0}
        if full is not None:
            both = [i for i in ids if i in full]
            if both:
                num = np.array([float(rows[i]["chain_tokens"]) for i in both])
                den = np.array([float(full[i]["chain_tokens"]) for i in both])
                if den.sum() > 0:
                    pidx = bootstrap_indices(len(both), n_boot, seed)
                    ratio = ci_ratio(num, den, pidx)
                    entry.update(compression=ratio[0], compression_ci=[ratio[1], ratio[2]])
                entry["paired_n"] = len(both)
        out.append(entry)
    return out


def summary_table(summary: Sequence[dict]) -> str:
    """The summary as a plain-text table, one line per budget."""
    def ci(v, lo_hi, fmt):
        return "n/a" if v is None else f"{v:{fmt}} [{lo_hi[0]:{fmt}}, {lo_hi[1]:{fmt}}]"

    lines = [f"{'γ':>5}  {'n':>5}  {'accuracy [95% CI]':<24}{'chain tokens [95% CI]':<28}"
             f"{'compression achieved [95% CI]':<32}finished  answer line"]
    for s in summary:
        lines.append(f"{s['budget']:>5g}  {s['n']:>5}  {ci(s['accuracy'], s['accuracy_ci'], '.3f'):<24}"
                     f"{ci(s['chain_tokens'], s['chain_tokens_ci'], '.1f'):<28}"
                     f"{ci(s['compression'], s['compression_ci'], '.3f'):<32}{s['finished']:<10.2f}"
                     f"{s['answer_line']:.2f}")
    return "\n".join(lines)
