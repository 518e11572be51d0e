"""Benchmark: MIST on long chains. For each chain length, the scorer's time in plain
forwards of the same input (median of alternating repeats, in one process) and the peak
memory beyond the loaded model (each in a process of its own, so that no earlier peak
counts).

    mist bench --sweep 256,1024,4096,7680                  # library defaults
    mist bench --sweep 4096,7680 --max-memory 1GB          # under a cap
    mist bench --sweep 8192 --model random:qwen2.5-7b --device cuda --dtype bfloat16

A chain is consecutive GSM8K training solutions joined into one, cut to the length, with the
first problem's question and answer (random tokens for a random: model)."""
from __future__ import annotations

import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def long_chain(lm, n_tokens: int, corpus: Path = TRAIN):
    from mist_core import Example, MistScorer, get_adapter

    if lm.tokenizer is None:  # a random-weight model: token ids are all it needs
        import numpy as np

        from mist_core.data.templates import Encoded

        rng = np.random.default_rng(n_tokens)
        prefix, chain, lead, answer = (rng.integers(0, lm.unembedding.shape[0], n)
                                       for n in (100, n_tokens, 4, 2))
        return Encoded(example=Example("q", "c", "a", id=f"len{n_tokens}"),
                       source_ids=np.concatenate([prefix, chain, lead, answer]), chain_start=100,
                       chain_len=n_tokens, answer_start=104 + n_tokens,
                       target_ids=np.concatenate([prefix, lead, answer]), target_final=103,
                       chain_offsets=np.zeros((n_tokens, 2), dtype=np.int64))
    adapt = get_adapter("gsm8k")
    tok = lm.tokenizer
    with open(corpus) as f:
        rows = (adapt(json.loads(line)) for line in f)
        first = next(rows)
        pieces, n = [], 0
        for ex in rows:
            pieces.append(ex.cot)
            n += len(tok(ex.cot + "\n\n", add_special_tokens=False)["input_ids"])
            if n >= n_tokens:
                break
    ids = tok("\n\n".join(pieces), add_special_tokens=False)["input_ids"][:n_tokens]
    cot = tok.decode(ids).strip()
    return MistScorer(lm).encode(Example(first.question, cot, first.answer, id=f"len{n_tokens}"))


def _rss(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _stolen_s() -> float | None:
    """Seconds the hypervisor has taken from this machine's CPUs so far, all CPUs together
    (the steal column of /proc/stat), or None where there is no such column."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def worker(spec: dict) -> dict:
    """One measurement in this process: `what` is time, score (memory) or forward (memory)."""
    from mist_core import MistScorer, load_model
    from pipelines.bench.shapes import random_model

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = spec["device"]
    if spec["model"].startswith("random:"):
        lm = random_model(spec["model"].split(":", 1)[1], spec["dtype"], device,
                          context=spec["tokens"] + 512)
    else:
        lm = load_model(spec["model"], dtype=spec["dtype"], device=device)
    enc = long_chain(lm, spec["tokens"])
    kwargs = {} if spec.get("max_memory") is None else {"max_memory": spec["max_memory"]}
    scorer = MistScorer(lm, max_tokens=spec.get("batch_tokens") or 4096, **kwargs)
    ids = torch.tensor(enc.source_ids, device=device)[None]

    def forward():
        with torch.no_grad():  # what a user calls a forward: the model, logits included
            lm.model(input_ids=ids, use_cache=False)

    returns_errors = "errors" in inspect.signature(scorer.score_encoded).parameters

    def score():  # (an earlier checkout's scorer, measured with --code, has no `errors`)
        [res] = scorer.score_encoded([enc], errors="return") if returns_errors else \
            scorer.score_encoded([enc])
        if not hasattr(res, "scores"):
            raise RuntimeError(str(res))

    import mist_core

    out = {"tokens": len(enc.source_ids), "chain_tokens": enc.chain_len,
           "mist_core": str(Path(mist_core.__file__).parent),
           "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE")}
    with torch.no_grad():
        lm.model(input_ids=ids[:, :8], use_cache=False)  # weights touched: the loaded model
    if hasattr(scorer, "footprint") and kwargs:
        scorer.footprint  # measured before the peak is reset: a one-off at load time
    if spec["what"] == "time":
        # On a virtual machine the hypervisor takes CPU time from a run at random (in spells;
        # docs/results/performance.md): the CPU seconds this process used and the
        # seconds stolen meanwhile are kept beside the wall time, so that a run can be read
        # with the stolen time left out.
        forward(), score()  # warm-up
        tf, ts, cf, cs, steal = [], [], [], [], []
        # forward, score, forward, ..., score, forward: each scoring between two forwards
        for fn, acc, cpu in [(forward, tf, cf), (score, ts, cs)] * spec["repeats"] + [(forward, tf, cf)]:
            _sync(device)
            t, c, s0 = time.perf_counter(), time.process_time(), _stolen_s()
            fn()
            _sync(device)
            acc.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            s1 = _stolen_s()
            steal.append(None if s0 is None or s1 is None else s1 - s0)
        out.update(forward_s=statistics.median(tf), score_s=statistics.median(ts),
                   forward_runs=tf, score_runs=ts, forward_cpu_runs=cf, score_cpu_runs=cs,
                   stolen_runs=steal)
        out["forward_equivalents"] = out["score_s"] / out["forward_s"]
        # each scoring against the mean of the forwards just before and after it: where the
        # machine's speed drifts from repeat to repeat (in CPU seconds too; how much:
        # docs/results/performance.md), like is compared with like
        out["forward_equivalents_paired"] = statistics.median(
            s / ((a + b) / 2) for s, a, b in zip(ts, tf, tf[1:]))
        # the fastest repeat of each: what the machine's noise, which only adds time, touched least
        out["forward_equivalents_fastest"] = min(ts) / min(tf)
        # the same ratio in CPU seconds: what the hypervisor takes does not count, but
        # neither does a thread that sleeps while another finishes its share
        out["forward_equivalents_cpu"] = statistics.median(cs) / statistics.median(cf)
        if None not in steal:
            out["stolen_share"] = sum(steal) / (os.cpu_count() or 1) / (sum(tf) + sum(ts))
        out["score_s_per_1k_tokens"] = 1000 * out["score_s"] / out["tokens"]
        if hasattr(scorer, "plan"):
            plan = scorer.plan([enc])
            out["recompute"] = bool(getattr(plan, "recompute", False))
            out["mlp_pieces"] = bool(getattr(plan, "mlp_pieces", False))
            out["keep_every"] = int(getattr(plan, "keep_every", 1))
            out["attention_kept"] = int(getattr(plan, "attention_kept", 0))
            out["shares_prefix"] = scorer.shares_prefix(enc) if hasattr(scorer, "shares_prefix") else True
        return out
    fn = score if spec["what"] == "score" else forward
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        out["peak_over_model_bytes"] = torch.cuda.max_memory_allocated() - base
        out["model_bytes"] = base
    else:
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM: the peak from here on
        fn()
        out["peak_over_model_bytes"] = _rss("VmHWM") - base
        out["model_bytes"] = base
    return out


def _run(spec: dict, python: str, env: dict) -> dict:
    cmd = [python, "-m", "pipelines.bench.long", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep(args, save=None) -> dict:
    """Each length: a timing process, then a memory process for the scorer and one for the
    forward. `--code DIR` measures another checkout's mist_core (before/after). `save` gets
    the result so far after each length, so a sweep cut off by a time limit keeps its rows."""
    env = dict(os.environ)
    if torch.device(args.device).type == "cpu":  # as the job's CPU actors run
        from mist_core.scoring.allocator import cpu_scoring_env

        env.update(cpu_scoring_env())
    rows = []
    result = {"model": args.model, "dtype": args.dtype, "device": args.device,
              "max_memory": args.max_memory, "code": args.code or str(ROOT), "sweep": rows}
    for n in args.sweep:
        spec = {"model": args.model, "dtype": args.dtype, "device": args.device, "tokens": n,
                "threads": args.threads, "repeats": args.repeats, "max_memory": args.max_memory,
                "batch_tokens": args.batch_tokens,
                "code": str(Path(args.code).resolve()) if args.code else None}
        row = {"chain_tokens": n}
        for what in ("time", "score", "forward"):
            res = _run({**spec, "what": what}, sys.executable, env)
            if "error" in res:
                row[f"{what}_error"] = res["error"]
                continue
            if what == "time":
                row.update({k: v for k, v in res.items() if k != "chain_tokens"})
            else:
                row[f"{what}_peak_over_model_bytes"] = res["peak_over_model_bytes"]
                row["model_bytes"] = res["model_bytes"]
        rows.append(row)
        print(sweep_line(row), flush=True)
        if save:
            save(result)
    return result


def regime(r: dict) -> str:
    """The recomputed regime a row ran in, in words."""
    words = ["recomputed"]
    if r.get("mlp_pieces"):
        words.append("MLP in pieces")
    if r.get("keep_every", 1) > 1:
        words.append(f"every {r['keep_every']}th state kept")
    if r.get("attention_kept"):
        words.append(f"attention kept in {r['attention_kept']} blocks")
    return ", ".join(words)


def sweep_line(r: dict) -> str:
    gib = 2**30
    parts = [f"{r['chain_tokens']:>6} chain tokens"]
    if "forward_equivalents" in r:
        parts.append(f"{r['forward_equivalents']:.2f} forwards ({r['score_s']:.1f}s vs {r['forward_s']:.1f}s, "
                     f"{r['score_s_per_1k_tokens']:.2f}s per 1k tokens"
                     f"{', ' + regime(r) if r.get('recompute') else ''})")
        if "forward_equivalents_cpu" in r:
            stolen = f", {100 * r['stolen_share']:.0f}% of the CPUs stolen" if "stolen_share" in r else ""
            paired = (f"each scoring between two forwards {r['forward_equivalents_paired']:.2f}, "
                      if "forward_equivalents_paired" in r else "")
            parts.append(f"{paired}fastest repeats {r['forward_equivalents_fastest']:.2f}, "
                         f"{r['forward_equivalents_cpu']:.2f} in CPU seconds{stolen}")
    for what in ("score", "forward"):
        if f"{what}_peak_over_model_bytes" in r:
            parts.append(f"{what} peak +{r[f'{what}_peak_over_model_bytes'] / gib:.2f} GiB")
    parts += [f"{k}: {v}" for k, v in r.items() if k.endswith("_error")]
    return " | ".join(parts)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("code"):  # that checkout's mist_core, imported first (nothing has imported it yet)
        sys.path.insert(0, spec["code"])
    result = worker(spec)
    print(json.dumps(result))
