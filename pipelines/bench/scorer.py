"""Benchmark: how close MIST scoring runs to the cost of a plain forward pass.

    mist bench                       # SmolLM2-135M-Instruct on 256 GSM8K test chains
    mist bench --smoke               # seconds: a tiny random model, CI's version
    mist bench --model random:qwen2.5-1.5b --synthetic 512 --chain-tokens 350 \
        --device cuda --dtype bfloat16              # the GPU benchmark (see benchmarks/gpu.sh)
    mist bench --pipeline            # also the Ray job ÷ a bare loop on the same chains

All figures are ratios or rates measured in one run (medians over --repeats), printed as a
table and written as JSON (--json)."""
from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from pydantic import field_validator

from mist_core import Example, MistScorer, get_adapter, load_model
from mist_core.data.templates import Encoded
from mist_core.scoring import allocator
from mist_core.scoring.choices import TARGETS
from mist_core.scoring.exact import exact_scores_encoded
from mist_core.scoring.scorer import shared_prefix
from mist_core.scoring.tracing import pad

from ..common import exits, settings
from ..common.errors import ConfigError
from ..common.settings import Model, auto_or, listed, positive, setting, shown
from .shapes import random_model

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
PEAK_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}  # H200 SXM, dense


def synthetic_encoded(n: int, chain_tokens: int, vocab: int, seed: int = 0) -> list[Encoded]:
    """Chains of random tokens shaped like a chat prompt: a question prefix, the chain, an
    answer line. Speed does not depend on which tokens they are."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        q, t = int(rng.integers(60, 140)), max(1, int(rng.normal(chain_tokens, chain_tokens / 5)))
        prefix, chain = rng.integers(0, vocab, q), rng.integers(0, vocab, t)
        lead, answer = rng.integers(0, vocab, 4), rng.integers(0, vocab, int(rng.integers(1, 4)))
        out.append(Encoded(example=Example("q", "c", "a", id=str(i)),
                           source_ids=np.concatenate([prefix, chain, lead, answer]),
                           chain_start=q, chain_len=t, answer_start=q + t + 4,
                           target_ids=np.concatenate([prefix, lead, answer]),
                           target_final=q + 3, chain_offsets=np.zeros((t, 2), dtype=np.int64)))
    return out


def gsm8k_encoded(scorer: MistScorer, n: int, path: Path = GSM8K) -> list[Encoded]:
    adapt = get_adapter("gsm8k")
    with open(path) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    return [scorer.encode(adapt(r)) for r in rows]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, device, warmup=None) -> float:
    """Median seconds of `repeats` runs, after a warm-up (`fn` itself unless given)."""
    (warmup or fn)()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plain_forward(lm, encoded, batches, head: bool):
    """One forward pass of the full inputs over the scorer's batches (`head`: with the
    LM head over every position, as `model(...)` computes it)."""
    with torch.no_grad():
        for idx in batches:
            ids, mask = pad([encoded[i].source_ids for i in idx], lm.pad_id, lm.device)
            (lm.model if head else lm.base)(input_ids=ids, attention_mask=mask, use_cache=False)


def fair_forward(lm, encoded, batch: int = 8):
    """The forward a user would write: the full inputs in length-sorted batches of `batch`,
    through the whole model, logits at every position included."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].source_ids))
    with torch.no_grad():
        for j in range(0, len(order), batch):
            ids, mask = pad([encoded[i].source_ids for i in order[j:j + batch]], lm.pad_id, lm.device)
            lm.model(input_ids=ids, attention_mask=mask, use_cache=False)


class PositionCounter:
    """Counts the positions the blocks compute while active (padding included)."""

    def __init__(self, lm):
        self.lm, self.computed = lm, 0

    def __enter__(self):
        def count(module, args, kwargs):
            self.computed += (args[0] if args else kwargs["hidden_states"]).shape[:2].numel()
        self.hook = self.lm.blocks[0].register_forward_pre_hook(count, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.hook.remove()


def padding_share(computed: int, encoded) -> float:
    """Padded positions over all positions the scorer's blocks computed."""
    real = sum(len(e.source_ids) + len(e.target_ids) - shared_prefix(e) for e in encoded)
    return 1 - real / computed


def model_flops(lm, encoded) -> float:
    """Useful FLOPs of one scoring: 2N per token forward, 2N more for the activation-only
    backward, N = non-embedding parameters; prefix forward only."""
    n = sum(p.numel() for name, p in lm.model.named_parameters() if "embed" not in name and "lm_head" not in name)
    fwd = sum(shared_prefix(e) for e in encoded)
    both = sum(len(e.source_ids) + len(e.target_ids) - 2 * shared_prefix(e) for e in encoded)
    return 2 * n * fwd + 4 * n * both


def top_agreement(a: np.ndarray, b: np.ndarray, gamma: float) -> float:
    k = math.ceil(gamma * len(a) - 1e-9)
    return len(set(np.argsort(-a, kind="stable")[:k]) & set(np.argsort(-b, kind="stable")[:k])) / k


def peak_memory_mb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench(args) -> dict:
    torch.set_num_threads(args.threads) if args.threads else None
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if args.model.startswith("random:"):
        lm = random_model(args.model.split(":", 1)[1], args.dtype, args.device)
    else:
        lm = load_model(args.model, dtype=args.dtype, device=args.device)
    scorer = MistScorer(lm, max_tokens=args.batch_tokens, max_batch=args.batch_size,
                        target=args.target)
    if args.synthetic:
        encoded = synthetic_encoded(args.synthetic, args.chain_tokens, lm.model.config.vocab_size)
    else:
        encoded = gsm8k_encoded(scorer, args.chains, Path(args.corpus))
    batches = scorer.forward_batches(encoded)
    warm = batches[:1]
    # The forwards run on freed memory kept in the process, as the scorer's stored passes
    # do: with glibc's defaults each forward maps its logits anew (page faults and seconds of
    # system time a forward: docs/results/performance.md), which would flatter the scorer.
    allocator.keep_freed(lm.device)
    t_fwd = timed(lambda: plain_forward(lm, encoded, batches, head=True), args.repeats, args.device,
                  lambda: plain_forward(lm, encoded, warm, head=True))
    t_body = timed(lambda: plain_forward(lm, encoded, batches, head=False), args.repeats, args.device,
                   lambda: plain_forward(lm, encoded, warm, head=False))
    t_fair = timed(lambda: fair_forward(lm, encoded), args.repeats, args.device)
    scorer.score_encoded([encoded[i] for i in warm[0]])  # warm-up, outside the count
    with PositionCounter(lm) as counter:
        t_score = timed(lambda: scorer.score_encoded(encoded), args.repeats, args.device,
                        warmup=lambda: None)
    tokens = sum(len(e.source_ids) for e in encoded)
    result = {
        "model": lm.name, "device": args.device, "dtype": args.dtype, "target": args.target,
        "chains": len(encoded),
        "mean_tokens": tokens / len(encoded), "mean_chain_tokens": float(np.mean([e.chain_len for e in encoded])),
        "batch_tokens": args.batch_tokens, "repeats": args.repeats,
        "forward_s": t_fwd, "forward_no_head_s": t_body, "forward_sorted_8_s": t_fair,
        "score_s": t_score, "forward_equivalents": t_score / t_fwd,
        "forward_equivalents_no_head": t_score / t_body,
        "forward_equivalents_sorted_8": t_score / t_fair,
        "chains_per_s": len(encoded) / t_score, "tokens_per_s": tokens / t_score,
        "padding_share": padding_share(counter.computed // args.repeats, encoded),
        "peak_memory_mb": peak_memory_mb(args.device),
    }
    if args.device.startswith("cuda"):
        result["mfu"] = model_flops(lm, encoded) / t_score / PEAK_FLOPS[args.dtype]
    if args.exact_chains:
        short = sorted(encoded, key=lambda e: e.chain_len)[: args.exact_chains]
        layers = list(range(1, lm.n_layers + 1))[:: args.exact_layer_stride]
        t_first = timed(lambda: [scorer.score_encoded([e]) for e in short], 1, args.device)
        start = time.perf_counter()
        for e in short:
            exact_scores_encoded(lm, e, layers=layers)
        t_exact = (time.perf_counter() - start) * lm.n_layers / len(layers)
        result.update(exact_chains=len(short), exact_layers_timed=len(layers),
                      exact_over_first_order=t_exact / t_first)
    if args.agreement and lm.tokenizer is not None:
        result["agreement"] = agreement(args, encoded[: args.agreement])
    return result


def agreement(args, encoded) -> dict:
    """Top-γ agreement of lower precisions with fp32 on the same chains (keep an option only
    where agreement at γ = 0.5 is at least 0.95)."""
    ref = MistScorer(load_model(args.model, dtype="float32", device=args.device)).score_encoded(encoded)
    out = {}
    for dtype in ("bfloat16",):
        other = MistScorer(load_model(args.model, dtype=dtype, device=args.device)).score_encoded(encoded)
        out[dtype] = {str(g): float(np.mean([top_agreement(a.scores, b.scores, g) for a, b in zip(ref, other)]))
                      for g in (0.3, 0.5)}
    return out


def table(r: dict) -> str:
    if "model" not in r:  # --pipeline-only
        return (f'Ray job ÷ bare loop throughput, end to end  {r["pipeline_over_bare"]:.2f}\n'
                f'  ... steady state (scoring part only)     {r["pipeline_steady_over_bare_scoring"]:.2f}')
    rows = [("model", r["model"]), ("device / dtype", f'{r["device"]} / {r["dtype"]}'),
            ("chains (mean tokens, chain tokens)", f'{r["chains"]} ({r["mean_tokens"]:.0f}, {r["mean_chain_tokens"]:.0f})'),
            ("MIST scoring, forward-equivalents", f'{r["forward_equivalents"]:.2f}'),
            ("  ... against a forward without the LM head", f'{r["forward_equivalents_no_head"]:.2f}'),
            ("  ... against length-sorted batches of 8 (full model)", f'{r["forward_equivalents_sorted_8"]:.2f}'),
            ("chains/s", f'{r["chains_per_s"]:.2f}'), ("tokens/s", f'{r["tokens_per_s"]:.0f}'),
            ("padding share of computed positions", f'{r["padding_share"]:.1%}'),
            ("peak memory (MiB)", f'{r["peak_memory_mb"]:.0f}')]
    if "mfu" in r:
        rows.append(("model FLOPs utilisation", f'{r["mfu"]:.1%}'))
    if "exact_over_first_order" in r:
        rows.append(("exact ÷ first-order time", f'{r["exact_over_first_order"]:.0f}'))
    if "pipeline_over_bare" in r:
        rows.append(("Ray job ÷ bare loop throughput, end to end", f'{r["pipeline_over_bare"]:.2f}'))
        rows.append(("  ... steady state (scoring part only)", f'{r["pipeline_steady_over_bare_scoring"]:.2f}'))
    for dtype, agr in r.get("agreement", {}).items():
        rows.append((f"top-γ agreement {dtype} vs fp32 (γ=0.3, 0.5)", f'{agr["0.3"]:.3f}, {agr["0.5"]:.3f}'))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _ints(v) -> list[int] | None:
    if v is None:
        return None
    try:
        return [int(x) for x in listed(v) if str(x).strip()]
    except (TypeError, ValueError):
        raise ConfigError(f"sweep takes chain lengths like 256,1024, not {shown(v)}") from None


class BenchConfig(Model):
    """`mist bench`'s settings. --model also takes random:<shape>, a random model of a
    known architecture's shape (pipelines/bench/shapes.py)."""

    corpus: str = setting(str(GSM8K), "GSM8K-format JSONL", group="input", metavar="FILE",
                          shown="../shared GSM8K test")
    chains: int = setting(256, "corpus chains to score; padding falls as batches can be "
                          "bucketed finer", group="input", metavar="N")
    synthetic: int = setting(0, "use N random-token chains instead of a corpus", group="input",
                             metavar="N")
    chain_tokens: int = setting(350, "mean chain length of synthetic chains", group="input",
                                metavar="N")
    target: str = setting(TARGETS[0], "what MIST's necessity is the gradient of "
                          "(MistScorer's target; both: one more backward)", group="input",
                          choices=TARGETS)
    device: str = setting("cpu", "torch device", group="resources")
    tf32: bool = setting(False, "allow TF32 matmuls (Ampere and later)", group="resources")
    batch_tokens: int | str = setting(4096, "padded tokens per forward pass, or auto (as many "
                                      "as --max-memory holds)", group="resources", metavar="N")
    batch_size: int = setting(32, "chains per forward pass", group="resources", metavar="N")
    threads: int = setting(0, "torch threads (0: torch's default)", group="resources",
                           metavar="N")
    max_memory: str | None = setting(None, "the scorer's memory cap in the sweep, e.g. 1GB",
                                     group="resources", metavar="SIZE", shown="")
    repeats: int = setting(3, "timed repeats (medians over them)", group="measure", metavar="N")
    exact_chains: int = setting(2, "chains timed with exact interventions", group="measure",
                                metavar="N")
    exact_layer_stride: int = setting(6, "time exact interventions on every n-th layer and "
                                      "scale to all layers", group="measure", metavar="N")
    agreement: int = setting(0, "chains for the bf16-vs-fp32 agreement", group="measure",
                             metavar="N")
    pipeline: bool = setting(False, "also measure the Ray job against a bare loop",
                             group="measure")
    pipeline_only: bool = setting(False, "measure only the Ray job against a bare loop",
                                  group="measure")
    smoke: bool = setting(False, "seconds-long run on a tiny random model", group="measure")
    sweep: list[int] | None = setting(
        None, "chain lengths (e.g. 256,1024,4096,7680): cost and peak memory of one long chain "
        "against a plain forward, per length (see pipelines/bench/long.py)", group="measure",
        metavar="LIST", shown="")
    code: str | None = setting(None, "with --sweep: measure the mist_core of another checkout "
                               "(e.g. a git worktree of an earlier commit)", group="measure",
                               metavar="DIR", shown="")
    json_path: str | None = setting(None, "write the results here too", group="output",
                                    metavar="FILE", shown="", flag="json")

    _positive = positive("chains", "batch_size", "repeats", "exact_layer_stride")
    _sweep = field_validator("sweep", mode="before")(classmethod(lambda cls, v: _ints(v)))

    @field_validator("batch_tokens", mode="before")
    @classmethod
    def _batch_tokens(cls, v):
        tokens = auto_or(v, int)
        if tokens is not None and tokens < 1:
            raise ConfigError("batch_tokens must be at least 1 or auto")
        return "auto" if tokens is None else tokens

    def _check_more(self) -> None:
        pipeline = self.pipeline or self.pipeline_only
        if pipeline and (self.synthetic or self.model.startswith("random:") or self.smoke):
            raise ConfigError("--pipeline runs the job on a corpus with a loadable model: not "
                              "with --synthetic, --smoke or a random: model")


def parse(argv: list[str] | None = None, prog: str = "mist bench") -> BenchConfig:
    """The benchmark's settings from its command line, --smoke's sizes filled in."""
    args = settings.parse(BenchConfig, argv, prog, __doc__)
    changes = {"pipeline": args.pipeline or args.pipeline_only}
    if args.smoke:
        changes.update(model="random:tiny", synthetic=16, chain_tokens=40, repeats=1,
                       exact_chains=1, exact_layer_stride=2)
    return args.model_copy(update=changes)


def main(argv: list[str] | None = None, prog: str = "mist bench") -> int:
    """`mist bench`: the scorer's cost against a plain forward pass, printed and in --json.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for bad settings."""
    return exits.run_main(lambda: run(parse(argv, prog)))


def run(args: BenchConfig) -> int:
    if args.sweep:
        from .long import sweep

        result = sweep(args, save=lambda partial: save_json(args, partial))
    else:
        result = {} if args.pipeline_only else bench(args)
        if args.pipeline:
            from .pipeline import pipeline_over_bare

            result.update(pipeline_over_bare(args))
        print(table(result))
    save_json(args, result)
    return 0


def save_json(args: BenchConfig, result: dict) -> None:
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
