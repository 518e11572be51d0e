"""A generated reasoning task whose needed chain tokens are known: the testbed that trains
a small model on chains compressed by each method and compares the models it gives
(pipelines/loop/testbed.py).

A problem is a short word problem over 2-4 chained operations (+, -, *) on small integers,
padded with filler sentences and distractor facts that carry numbers of their own. Its
chain narrates each step and writes it as one equation (`She buys 4 more, so 3 + 4 = 7.`),
with filler and restated distractors in between. The ground truth of what a compression
must keep is one copy of every needed quantity and operation: the operands, the operator
and the result of each step's equation. Everything else (the narration that restates the
operand, filler, distractor numbers, a closing restatement of the result) can go without
losing information the answer needs.

The same labeller (`needed_spans`) finds those equations in the chains a trained model
writes itself, by their values in step order, so Phase 0 chains get ground truth too.

Also here: a word-level tokenizer over the generator's vocabulary (each number one token),
so that a model of a few hundred thousand parameters learns the task in minutes on a CPU,
and the tiny Llama config it is trained from."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

MAX_VALUE = 40  # every value a chain reaches stays within 1..MAX_VALUE
MAX_NUMBER = 99  # every number token up to this is in the vocabulary
OPS = ("+", "-", "*")

# (name, subject pronoun, object pronoun)
PEOPLE = [("Ann", "she", "her"), ("Ben", "he", "him"), ("Cara", "she", "her"),
          ("Dan", "he", "him"), ("Eve", "she", "her"), ("Finn", "he", "him"),
          ("Gia", "she", "her"), ("Hal", "he", "him")]
ITEMS = ["apples", "pens", "coins", "cards", "shells", "books", "stamps", "marbles"]

# One step: (question sentence, chain narration). {b} is the operand; the chain's equation
# follows the narration after ", so ".
STEP_PHRASES = {
    "+": [("{Sub} buys {b} more {item}.", "{Sub} buys {b} more"),
          ("{Sub} finds {b} more {item}.", "{Sub} finds {b} more"),
          ("A friend gives {obj} {b} more {item}.", "A friend gives {obj} {b} more")],
    "-": [("{Sub} gives away {b} {item}.", "{Sub} gives away {b}"),
          ("{Sub} loses {b} {item}.", "{Sub} loses {b}"),
          ("{Sub} sells {b} {item}.", "{Sub} sells {b}")],
    "*": [("Then the number of {item} {sub} has doubles.", "The number doubles"),
          ("Then the number of {item} {sub} has triples.", "The number triples")],
}

# Distractors: (question sentence, chain restatement that dismisses it); {k} is its number.
DISTRACTORS = [
    ("{Name} is {k} years old.", "{Sub} is {k} years old, but that does not matter."),
    ("{Other} has {k} {other_item}.", "The {k} {other_item} of {Other} do not count."),
    ("The shop is {k} minutes away.", "The {k} minutes do not matter."),
    ("{Name} has {k} friends at school.", "The {k} friends do not change the count."),
]
QUESTION_FILLER = ["It is a sunny day.", "{Name} likes to count things.",
                   "The {item} are kept in a box."]
CHAIN_FILLER = ["Let me keep track.", "That is a lot of {item}.", "Now I check the next step.",
                "The {item} are kept in a box."]

EQUATION = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")
# The verbs of the chain's step narrations (STEP_PHRASES), each naming its question sentence.
CUE = re.compile(r"\b(?:buys|finds|gives away|gives|loses|sells|doubles|triples)\b")
START = re.compile(r"\bstarts with \d+")


@dataclass(frozen=True)
class Step:
    op: str
    operand: int
    before: int
    after: int


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    cot: str
    answer: str
    steps: tuple[Step, ...]
    needed: tuple[tuple[int, int], ...]  # character spans in cot, in order

    def row(self) -> dict:
        return {"id": self.id, "question": self.question, "cot": self.cot, "answer": self.answer,
                "steps": [[s.op, s.operand, s.before, s.after] for s in self.steps]}


def apply(op: str, x: int, b: int) -> int:
    return x + b if op == "+" else x - b if op == "-" else x * b


def _steps(rng: random.Random, n: int) -> list[Step]:
    x = rng.randint(2, 15)
    out = []
    for _ in range(n):
        allowed = [op for op in OPS if (op == "+" and x + 2 <= MAX_VALUE)
                   or (op == "-" and x - 2 >= 1) or (op == "*" and x * 2 <= MAX_VALUE)]
        op = rng.choice(allowed)
        if op == "+":
            b = rng.randint(2, min(9, MAX_VALUE - x))
        elif op == "-":
            b = rng.randint(2, min(9, x - 1))
        else:
            b = rng.choice([m for m in (2, 3) if x * m <= MAX_VALUE])
        y = apply(op, x, b)
        out.append(Step(op, b, x, y))
        x = y
    return out


def _fill(template: str, **kw) -> str:
    kw.setdefault("Sub", kw.get("sub", "").capitalize())
    return template.format(**kw)


def make_problem(rng: random.Random, id: str, n_steps: tuple[int, int] = (2, 4)) -> Problem:
    """One problem of n_steps[0]..n_steps[1] operations."""
    name, sub, obj = rng.choice(PEOPLE)
    other = rng.choice([p[0] for p in PEOPLE if p[0] != name])
    item, other_item = rng.sample(ITEMS, 2)
    steps = _steps(rng, rng.randint(*n_steps))
    names = dict(Name=name, name=name, sub=sub, Sub=sub.capitalize(), obj=obj, item=item,
                 Other=other, other_item=other_item)

    distractors = [(d, rng.randint(2, 30)) for d in rng.sample(DISTRACTORS, rng.randint(1, 2))]
    q = [f"{name} has {steps[0].before} {item}."]
    c_parts: list[tuple[str, bool]] = [(f"{name} starts with {steps[0].before} {item}.", False)]
    # question and chain sentences between the steps: distractors, filler
    q_extra = [_fill(d[0], k=k, **names) for d, k in distractors]
    q_extra += [_fill(f, **names) for f in rng.sample(QUESTION_FILLER, rng.randint(0, 1))]
    c_extra = [_fill(d[1], k=k, **names) for d, k in distractors if rng.random() < 0.5]
    c_extra += [_fill(f, **names) for f in rng.sample(CHAIN_FILLER, rng.randint(0, 2))]
    rng.shuffle(q_extra)
    rng.shuffle(c_extra)
    q_slots = [[] for _ in steps]
    c_slots = [[] for _ in steps]
    for s in q_extra:
        q_slots[rng.randrange(len(steps))].append(s)
    for s in c_extra:
        c_slots[rng.randrange(len(steps))].append(s)

    for i, st in enumerate(steps):
        q += q_slots[i]
        if st.op == "*":  # the question names the multiplier by a word only
            word = "doubles" if st.operand == 2 else "triples"
            q_phrase, c_phrase = next(p for p in STEP_PHRASES["*"] if word in p[0])
        else:
            q_phrase, c_phrase = rng.choice(STEP_PHRASES[st.op])
        q.append(_fill(q_phrase, b=st.operand, **names))
        c_parts.append((_fill(c_phrase, b=st.operand, **names) + ", so ", False))
        c_parts.append((f"{st.before} {st.op} {st.operand} = {st.after}", True))
        c_parts.append((".", False))
        c_parts += [(" " + s, False) for s in c_slots[i]]
    q.append(f"How many {item} does {name} have now?")
    if rng.random() < 0.5:
        c_parts.append((f" So {name} has {steps[-1].after} {item} in the end.", False))

    # join the chain, recording the needed parts of each equation as they are placed
    cot, needed = "", []
    for i, (text, is_eq) in enumerate(c_parts):
        if i and not is_eq and not text.startswith((" ", ".")) and not cot.endswith(" "):
            cot += " "
        if is_eq:
            m = EQUATION.fullmatch(text)
            for g in (1, 2, 3, 4):  # operand, operator, operand, result; not the `=`
                needed.append((len(cot) + m.start(g), len(cot) + m.end(g)))
        cot += text
    return Problem(id=id, question=" ".join(q), cot=cot, answer=str(steps[-1].after),
                   steps=tuple(steps), needed=tuple(needed))


def make_problems(n: int, seed: int, prefix: str = "p", exclude: Iterable[str] = (),
                  n_steps: tuple[int, int] = (2, 4)) -> list[Problem]:
    """n problems with distinct questions, none of them in `exclude` (questions)."""
    rng = random.Random(seed)
    seen = set(exclude)
    out = []
    while len(out) < n:
        p = make_problem(rng, f"{prefix}{len(out)}", n_steps)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


# ---------------------------------------------------------------- ground truth

def _matched(cot: str, steps: Sequence[Step]) -> list[re.Match]:
    """Each step's equation (`x op b = y` with the step's values) in the chain, matched in
    step order; a step the chain skips or garbles has none."""
    out, at = [], 0
    eqs = list(EQUATION.finditer(cot))
    for st in steps:
        for j in range(at, len(eqs)):
            m = eqs[j]
            if (int(m[1]), m[2], int(m[3]), int(m[4])) == (st.before, st.op, st.operand, st.after):
                out.append(m)
                at = j + 1
                break
    return out


def needed_spans(cot: str, steps: Sequence[Step]) -> tuple[list[tuple[int, int]], int]:
    """The needed spans of any chain for a problem with these steps: each step's equation
    (`x op b = y` with the step's values), matched in step order, gives the spans of x, op,
    b and y. Returns (spans, steps found); a chain that skips or garbles a step has that
    step's spans missing (a generated chain can reach the right answer otherwise)."""
    found = _matched(cot, steps)
    return [m.span(g) for m in found for g in (1, 2, 3, 4)], len(found)


def cue_spans(cot: str, steps: Sequence[Step]) -> list[tuple[int, int]]:
    """What a *writer* needs beside the equations: the start (`starts with 9`, which copies
    the first value from the question before any equation uses it) and each step's cue, the
    verb of the narration before its equation (`loses` in `He loses 5, so 40 - 5 = 35`),
    which points the writer at the question's sentence the step comes from. The start where
    the chain states it before its first matched equation; one span per matched equation
    whose narration (the text since the previous equation) has a cue verb."""
    found = _matched(cot, steps)
    start = START.search(cot, 0, found[0].start()) if found else None
    spans = [start.span()] if start else []
    start = 0
    for m in found:
        cues = list(CUE.finditer(cot, start, m.start()))
        if cues:
            spans.append(cues[-1].span())
        start = m.end()
    return spans


def token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """bool [T]: the tokens (character offsets [T, 2]) that overlap any span."""
    offsets = np.asarray(offsets).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return mask


def precision_recall(kept: np.ndarray, needed: np.ndarray) -> tuple[float, float]:
    """Share of kept tokens that are needed, share of needed tokens that are kept
    (nan where the denominator is empty)."""
    kept, needed = np.asarray(kept, bool), np.asarray(needed, bool)
    hit = int((kept & needed).sum())
    return (hit / kept.sum() if kept.any() else float("nan"),
            hit / needed.sum() if needed.any() else float("nan"))


# ---------------------------------------------------------------- tokenizer and model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# One token per word or number with the space before it, one per other symbol (with its
# space), one per run of other whitespace: every character belongs to exactly one token,
# so decoding is plain concatenation and the text round-trips exactly.
PIECE = r" ?[A-Za-z]+| ?\d+| ?[^\sA-Za-z\d]|\s+"


def build_tokenizer(texts: Iterable[str]):
    """A word-level fast tokenizer over the pieces of `texts` (plus every word in both its
    spaced and unspaced form, and every number up to MAX_NUMBER), with a ChatML chat
    template, `<|im_end|>` as eos and `<|endoftext|>` as padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pattern = re.compile(PIECE)
    pieces = set()
    for t in texts:
        for p in pattern.findall(t):
            pieces.add(p)
            if p.strip() and not p[0].isspace() and p[0].isalnum():
                pieces.add(" " + p)
            elif p.startswith(" ") and p[1:]:
                pieces.add(p[1:])
    for n in range(MAX_NUMBER + 1):
        pieces |= {str(n), f" {n}"}
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(pieces))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token="<|im_start|>",
                                   unk_token="[UNK]", clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML
    return fast


def vocabulary_texts(budgets: Sequence[float] = (0.5, 0.6, 0.7, 0.8, 0.9)) -> list[str]:
    """Texts that hold every piece the task writes: a fixed sample of problems (which, at
    this size, uses every phrase of the generator), the phrase lists themselves, the
    directives of the budgets and the answer line."""
    from ..data.formats import directive
    from ..data.templates import ANSWER_LEAD

    texts = []
    for p in make_problems(2000, seed=12345, prefix="v"):
        texts += [p.question, p.cot]
    names = [w for person in PEOPLE for w in person]
    texts += names + [n.capitalize() for n in names] + ITEMS + [ANSWER_LEAD, "\n\n", "\n"]
    texts += ["user", "assistant", "system"]  # the chat template's role lines
    texts += [d for b in budgets if (d := directive(b))]
    for group in STEP_PHRASES.values():
        texts += [t for pair in group for t in pair]
    texts += [t for pair in DISTRACTORS for t in pair] + QUESTION_FILLER + CHAIN_FILLER
    return texts


def tiny_llama(tokenizer, *, layers: int = 4, hidden: int = 128, heads: int = 4,
               max_positions: int = 512, seed: int = 0):
    """A freshly initialised Llama for the task (untied embeddings, as the scorers read
    W_U separately)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
