"""`mist generate`: sample k chains per question of a question set with a model, keep the
shortest whose answer is right (--keep all: every right one), and write them as a corpus
the compression job reads as is
(`mist compress --input OUT --adapter generic`). The first step of the distillation loop:
generate, compress, train, solve.

The questions are read with the compression job's readers and adapters (a GSM8K file with
--adapter gsm8k, any JSONL/parquet with question and answer columns with the default generic
adapter) and sampled in a Ray Data actor pool, one model replica per actor, a GPU each where
the cluster has GPUs (through vLLM and ray.data.llm where vLLM is installed, else
transformers: --engine). OUT gets:
  chains.jsonl      the kept chains, one per question by default: id (<question
                    id>#<sample>), question, cot, answer (the gold answer), source_id; or
                    chains.parquet with --output-format parquet
  _rejected.jsonl   the samples left out, each with its reason: wrong_answer, no_answer (no
                    answer line, number or \\boxed{}: generation.read_answer), unfinished
                    (cut at --max-new-tokens), empty_chain, duplicate_chain (the same chain
                    as a kept sample of its question), not_shortest (a right chain longer
                    than the one kept, with --keep shortest)
  _manifest.json    settings, counts (questions read and skipped, samples, kept, rejected by
                    reason), timings
Files starting with `_` are not read as input by the compression job. A rerun replaces
the three files."""
from __future__ import annotations

import importlib.util
import sys
import time
from collections import Counter

import pyarrow as pa

from mist_core.errors import MissingDependency

from . import base as loop
from ..common import runtime, storage
from ..common.errors import ConfigError
from ..common.settings import parse, positive, setting

SAMPLE_SCHEMA = pa.schema([
    ("id", pa.string()), ("source_id", pa.string()), ("sample", pa.int64()),
    ("question", pa.string()), ("cot", pa.string()), ("answer", pa.string()),
    ("prediction", pa.string()), ("answer_line", pa.bool_()), ("correct", pa.bool_()),
    ("tokens", pa.int64()), ("finished", pa.bool_()),
])
CORPUS_COLUMNS = ("id", "question", "cot", "answer", "source_id")


class SampleActor:
    """One model replica; samples k chains for each question of a batch."""

    def __init__(self, *, model: str, dtype: str, device: str, threads: int | None, k: int,
                 style: str, temperature: float, top_p: float, max_new_tokens: int, seed: int,
                 batch_size: int, trust_remote_code: bool = False):
        self.lm = loop.load_lm(model, dtype, device, threads, trust_remote_code)
        self.kw = dict(k=k, style=style, temperature=temperature, top_p=top_p,
                       max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from mist_core.distill.generation import sample_chains

        return pa.Table.from_pylist(sample_chains(self.lm, batch.to_pylist(), **self.kw),
                                    schema=SAMPLE_SCHEMA)


# ---------------------------------------------------------------- vLLM (GPU clusters)
# Where vLLM is installed and the actors get GPUs, Ray Data's LLM processor runs the
# sampling (continuous batching, paged attention): many times transformers' throughput on
# a GPU. Each (question, sample) is one request with its own seed, built from the same
# prompt tokens as the transformers path; the judging is the same (sample_record).

def choose_engine(engine: str, gpus: float) -> str:
    """--engine auto: vllm where it is installed and the actors get GPUs, else transformers."""
    have_vllm = importlib.util.find_spec("vllm") is not None
    if engine == "auto":
        return "vllm" if have_vllm and gpus > 0 else "transformers"
    if engine == "vllm" and not have_vllm:
        raise MissingDependency("--engine vllm needs vLLM: pip install vllm")
    if engine == "vllm" and gpus <= 0:
        raise ConfigError("--engine vllm needs a GPU per actor (--gpus-per-actor, or a cluster "
                          "with GPUs)")
    return engine


def vllm_requests(questions: list[dict], tokenizer, *, k: int, seed: int) -> list[dict]:
    """One row per (question, sample): the question row, the sample's index and seed, and
    its prompt as text and token ids (generation.prompt_text's, encoded as generate does)."""
    from mist_core.distill.generation import encode_prompt, render_prompt, row_seed, user_turn

    out = []
    for q in questions:
        prompt = render_prompt(tokenizer, user_turn(q["question"]))
        ids = encode_prompt(tokenizer, prompt)
        out += [{**q, "sample": i, "prompt": prompt, "tokenized_prompt": ids,
                 "seed": row_seed(seed, prompt, i) % 2**31} for i in range(k)]
    return out


def vllm_request(row: dict, *, temperature: float, top_p: float, max_new_tokens: int) -> dict:
    """The processor's input row (its other columns reach vllm_sample unchanged)."""
    return {"prompt": row["prompt"], "tokenized_prompt": row["tokenized_prompt"],
            "sampling_params": {"temperature": temperature, "top_p": top_p,
                                "max_tokens": max_new_tokens, "seed": int(row["seed"])}}


def vllm_sample(row: dict, *, style: str, max_new_tokens: int) -> dict:
    """The processor's output row as a judged sample. vLLM stops at the model's
    end-of-sequence token, so a completion shorter than max_new_tokens finished."""
    from mist_core.distill.generation import Completion, sample_record

    n = int(row["num_generated_tokens"])
    return sample_record(row, int(row["sample"]),
                         Completion(row["generated_text"], n, n < max_new_tokens), style)


def vllm_samples(questions: list[dict], args: GenerateConfig, style: str):
    from functools import partial

    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    from transformers import AutoTokenizer

    from mist_core.models import model_path

    path = model_path(args.model)
    trust = getattr(args, "trust_remote_code", False)  # a caller's Namespace without it: off
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    requests = vllm_requests(questions, tokenizer, k=args.k, seed=args.seed)
    config = vLLMEngineProcessorConfig(
        model_source=path, concurrency=tuple(args.actors),
        engine_kwargs={"dtype": args.dtype, "trust_remote_code": trust},
        batch_size=args.batch_size * args.k,
        # the prompts come rendered and tokenized, exactly as the transformers path does it
        chat_template_stage=False, tokenize_stage=False, detokenize_stage=False)
    processor = build_processor(
        config,
        preprocess=partial(vllm_request, temperature=args.temperature, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens),
        postprocess=partial(vllm_sample, style=style, max_new_tokens=args.max_new_tokens))
    return processor(ray.data.from_items(requests))


# ---------------------------------------------------------------- keeping the right ones

def verdict(sample: dict, kept_chains: set) -> str | None:
    """Why a sample is left out, or None to keep it. A chain is trusted only when the model
    stopped by itself, stated an answer, and the answer is right."""
    if not sample["finished"]:
        return "unfinished"
    if sample["prediction"] is None:
        return "no_answer"
    if not sample["correct"]:
        return "wrong_answer"
    if not sample["cot"].strip():
        return "empty_chain"
    if (sample["source_id"], sample["cot"]) in kept_chains:
        return "duplicate_chain"
    return None


def select(samples: list[dict], keep: str = "shortest") -> tuple[list[dict], list[dict]]:
    """(kept corpus rows, rejected samples with their reason), in question then sample order.
    keep "shortest": of a question's right chains only the one of fewest tokens (the first
    sample among equals) is kept, the others are rejected as `not_shortest`."""
    from mist_core.distill.generation import shortest_per_question

    right, rejected, chains = [], [], set()
    for s in sorted(samples, key=lambda s: (s["source_id"], s["sample"])):
        reason = verdict(s, chains)
        if reason is None:
            chains.add((s["source_id"], s["cot"]))
            right.append(s)
        else:
            rejected.append({**s, "reason": reason})
    if keep == "shortest":
        best = shortest_per_question(right)
        rejected += [{**s, "reason": "not_shortest"} for s in right
                     if s is not best[s["source_id"]]]
        right = [s for s in right if s is best[s["source_id"]]]
        rejected.sort(key=lambda s: (s["source_id"], s["sample"]))
    return [{c: s[c] for c in CORPUS_COLUMNS} for s in right], rejected


def run(args: GenerateConfig) -> int:
    from mist_core.models import resolve

    t0 = time.perf_counter()
    st = loop.start(args)
    name, style, questions, qcounts = st.name, st.style, st.questions, st.counts
    pool, resources, device = st.pool, st.resources, st.device
    engine = choose_engine(args.engine, resources.get("num_gpus", 0))
    print(f"sampling {args.k} chains for each of {len(questions)} questions with {name} "
          f"on {device} through {engine} ({style} answers)", flush=True)
    import ray

    t_run = time.perf_counter()
    if engine == "vllm":
        ds = vllm_samples(questions, args, style)
    else:
        ds = ray.data.from_items(questions).map_batches(
            SampleActor, compute=pool, batch_size=args.batch_size, batch_format="pyarrow",
            fn_constructor_kwargs=dict(
                model=args.model, dtype=args.dtype, device=device,
                threads=int(args.cpus_per_actor), k=args.k, style=style,
                temperature=args.temperature, top_p=args.top_p,
                max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
                trust_remote_code=args.trust_remote_code),
            **resources)
    samples = []
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        samples += batch.to_pylist()
        print(f"[generate] {len(samples)}/{len(questions) * args.k} samples", flush=True)
    kept, rejected = select(samples, args.keep)
    run_s = time.perf_counter() - t_run

    corpus = storage.join(args.output, f"chains.{'parquet' if args.output_format == 'parquet' else 'jsonl'}")
    loop.write_rows(corpus, kept, args.output_format)
    loop.write_rows(storage.join(args.output, "_rejected.jsonl"), rejected)
    reasons = Counter(r["reason"] for r in rejected)
    counts = {**qcounts, "samples": len(samples), "kept": len(kept), "rejected": len(rejected),
              "rejected_by_reason": dict(sorted(reasons.items())),
              "questions_with_a_kept_chain": len({r["source_id"] for r in kept})}
    manifest = {
        "command": "mist generate", "output": storage.redact(args.output),
        "corpus": storage.redact(corpus),
        "settings": {"input": [storage.redact(u) for u in args.input], "adapter": args.adapter,
                     "columns": args.columns, "limit": args.limit, "style": style, "k": args.k,
                     "temperature": args.temperature, "top_p": args.top_p,
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                     "keep": args.keep},
        "model": {"spec": args.model, "name": name, "path": resolve(args.model)[0],
                  "dtype": args.dtype, "device": device, "engine": engine,
                  "trust_remote_code": args.trust_remote_code},
        "counts": counts,
        "versions": runtime.versions(),
        "timings": {"sample_s": round(run_s, 3), "total_s": round(time.perf_counter() - t0, 3)},
    }
    loop.write_json(storage.join(args.output, "_manifest.json"), manifest)
    print(f"kept {len(kept)} of {len(samples)} sampled chains "
          f"({counts['questions_with_a_kept_chain']}/{len(questions)} questions have one); "
          f"rejected: {', '.join(f'{k} {v}' for k, v in counts['rejected_by_reason'].items()) or 'none'}")
    print(f"corpus: {storage.redact(corpus)}  (mist compress --input {storage.redact(args.output)} "
          "--adapter generic)")
    if not kept:
        print("warning: no chain was kept: the compression job would have nothing to read",
              file=sys.stderr)
    return 0


class GenerateConfig(loop.Questions):
    """`mist generate`'s settings."""

    output_format: str = setting("jsonl", "the corpus's file format", group="output",
                                 choices=("jsonl", "parquet"))
    k: int = setting(4, "chains sampled per question", group="scoring", metavar="K")
    temperature: float = setting(0.7, "sampling temperature, >= 0", group="scoring",
                                 metavar="T")
    top_p: float = setting(0.95, "nucleus sampling's p, in (0, 1]", group="scoring",
                           metavar="P")
    seed: int = setting(0, "sampling seed", group="scoring")
    # The default by the testbed (docs/results/downstream.md, all_of_k against shortest_of_k):
    # every right chain trains a model no more accurate, that writes longer chains.
    keep: str = setting("shortest", "shortest: each question's right chain of fewest tokens "
                        "(the rest rejected as not_shortest); all: every right chain",
                        group="scoring", choices=("shortest", "all"))
    engine: str = setting("auto", "auto: vLLM through ray.data.llm where vLLM is installed and "
                          "the actors get GPUs, else transformers", group="resources",
                          choices=("auto", "transformers", "vllm"))

    _positive = positive("k")

    def _check_more(self) -> None:
        if not 0 < self.top_p <= 1 or not self.temperature >= 0:
            raise ConfigError("--top-p must lie in (0, 1] and --temperature be >= 0")


EPILOG = """\
example:
  mist generate --input ../shared/data/gsm8k/train.jsonl --adapter gsm8k --limit 200 \\
      --k 4 --output outputs/gen
  mist compress --input outputs/gen --adapter generic --output outputs/gen-mist
"""


def parse_args(argv: list[str] | None, prog: str) -> GenerateConfig:
    return parse(GenerateConfig, argv, prog, __doc__.split("\n\n")[0], EPILOG)


def main(argv: list[str] | None = None, prog: str = "mist generate") -> int:
    """`mist generate`: sample chains with a model and keep the shortest correct one of each
    question (or every correct one) as a corpus.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for bad settings, input or a model that cannot load, 4 for
        storage that stayed unavailable (pipelines.common.exits)."""
    return loop.run_main(run, sys.argv[1:] if argv is None else list(argv), parse_args, prog)


if __name__ == "__main__":
    sys.exit(main())
