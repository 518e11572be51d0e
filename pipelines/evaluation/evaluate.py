"""The evaluation harness: which compression method keeps what matters, measured.

For a sample of a corpus (read with the compression job's inputs, adapters and validation),
every chain is scored by every method; each method's pruning at each budget gives a
compressed chain c', on which we measure Eq. 1 (log p(a | x, c')), the greedy answer after
it, the intermediate results and number tokens it keeps, and the types of the tokens it
keeps. Once per chain: necessity vs sufficiency rank statistics; on a small subsample:
first-order vs exact interventions. One JSON record per chain goes to
<output>/results.jsonl as soon as it is done (a rerun resumes where a crash stopped);
<output>/run.json holds the settings, the command and the timings.
`mist report` turns one or more such folders into tables and plots.

Runs on a local Ray (default) or a cluster (--address or $RAY_ADDRESS); each actor holds
one model replica and evaluates whole chains."""
from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray

from mist_core.errors import InvalidExample, MissingDependency
from mist_core.measures.taxonomy import TYPES

from ..common import exits, runtime
from ..common.rows import parse_row, template_for
from ..common.errors import ConfigError
from .config import EvalConfig
from ..common.settings import one_line, parse
from .results import BASELINES, POSITIONAL, RESULTS, RUN, read_records, variant_name
from ..common.sources import read_raw, resolve_inputs

log = logging.getLogger("pipelines.evaluation.evaluate")

# Settings a resumed run must share with the results already in its folder.
_SAME = ("input", "adapter", "columns", "model", "methods", "budgets", "sample", "seed", "unit",
         "template", "dtype", "alpha", "style", "exact_n", "exact_layers", "extra_new")


def default_exact_layers(n_layers: int) -> list[int]:
    """Three blocks, at a quarter, half and three quarters of the depth: exact
    interventions rerun every block above the edited one, so deep layers are cheap and
    shallow ones dear, and all of a model's would cost many first-order scorings per chain
    (docs/results/performance.md)."""
    return sorted({min(n_layers, max(1, round(n_layers * q))) for q in (0.25, 0.5, 0.75)})


# ---------------------------------------------------------------- the actor

class EvalActor:
    """One model replica; evaluates whole chains, a batch of raw rows at a time."""

    def __init__(self, cfg: EvalConfig, device: str = "cpu"):
        import torch

        from mist_core import load_model
        from mist_core.scoring.registry import Scoring

        self.cfg = cfg
        if device == "cpu":
            torch.set_num_threads(self.cfg.threads or max(1, int(self.cfg.cpus_per_actor)))
        self.lm = load_model(self.cfg.model, dtype=self.cfg.dtype, device=device)
        common = dict(template=self.cfg.template, max_tokens=self.cfg.batch_tokens)
        # the paper's weights and target; mist_clipped from the same terms
        self.mist = Scoring("mist", alpha=self.cfg.alpha, layer_weights="signed",
                            target="answer", **common).scorer(self.lm)
        self.scorers, self.unavailable = {}, {}
        for name in self.cfg.methods:
            if name in BASELINES:
                try:
                    extra = {"seed": self.cfg.seed} if name == "uniform" else {}
                    self.scorers[name] = Scoring(name, **common, **extra).scorer(self.lm)
                except MissingDependency as e:
                    self.unavailable[name] = str(e)
        self.exact_layers = self.cfg.exact_layers or default_exact_layers(self.lm.n_layers)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        records, todo = [], []
        for r in rows:
            rec = {"source": r["source"], "row": r["row"], "status": "ok"}
            try:
                ex, _ = parse_row(r["raw"], self.cfg.adapter, self.cfg.columns)
                rec["id"] = ex.key
                todo.append((rec, self.mist.encode(ex), r["exact"]))
            except InvalidExample as e:
                rec.update(status="reject", reason=e.reason, detail=e.detail)
            records.append(rec)
        if todo:
            try:
                self._evaluate(todo)
            except Exception:  # one bad chain must not sink the batch: retry one by one
                log.exception("batch failed; evaluating its chains one by one")
                for item in todo:
                    try:
                        self._evaluate([item])
                    except Exception as e:
                        item[0].update(status="error", reason=type(e).__name__, detail=str(e))
        return pa.table({"record": [json.dumps(r, ensure_ascii=False) for r in records]})

    def _evaluate(self, todo: list) -> None:
        from mist_core.measures.answers import style_for
        from mist_core.measures.evaluation import evaluate_chain
        from mist_core.measures.retention import pack_mask
        from mist_core.measures.stats import spearman, top_overlap

        encs = [enc for _, enc, _ in todo]
        scored, seconds = {}, {}
        t = time.perf_counter()
        scored["mist"] = self.mist.score_encoded(encs)
        seconds["mist"] = (time.perf_counter() - t) / len(encs)
        for name, scorer in self.scorers.items():
            t = time.perf_counter()
            scored[name] = scorer.score_encoded(encs)
            seconds[name] = (time.perf_counter() - t) / len(encs)
        for i, (rec, enc, exact) in enumerate(todo):
            t = time.perf_counter()
            ex, s = enc.example, scored["mist"][i]
            style = self.cfg.style if self.cfg.style != "auto" else style_for(self.cfg.adapter, ex.cot)
            variants = self._variants(enc, s, {n: v[i] for n, v in scored.items()})
            res = evaluate_chain(self.lm, enc, variants, style, extra_new=self.cfg.extra_new,
                                 max_tokens=self.cfg.batch_tokens)
            for name, kept in variants.items():
                res[name]["kept"] = pack_mask(kept)
            rho = spearman(s.necessity, s.sufficiency)
            over, jac = top_overlap(s.necessity, s.sufficiency, 0.3)
            rec.update(question=ex.question, cot=ex.cot, answer=ex.answer, style=style,
                       T=enc.chain_len, offsets=enc.chain_offsets.reshape(-1).tolist(),
                       chain=res.pop("_chain"), ll_full=s.log_likelihood,
                       ll_nochain=s.nochain_log_likelihood, variants=res,
                       rank={"spearman": rho, "overlap30": over, "jaccard30": jac},
                       unavailable=self.unavailable,
                       seconds={"score": seconds, "measures": time.perf_counter() - t})
            if exact:
                t = time.perf_counter()
                rec["exact"] = self._exact(enc, s)
                rec["seconds"]["exact"] = time.perf_counter() - t

    def _variants(self, enc, s, scored: dict) -> dict:
        """name -> kept mask for every method and budget, plus the two ends."""
        from mist_core.measures.evaluation import NOCHAIN, positional_scores
        from mist_core.scoring.prune import prune_scores
        from mist_core.scoring.scorer import combine, eq7

        scores = {"mist": s.scores, "necessity": combine(s.necessity, None, self.cfg.alpha),
                  "sufficiency": combine(None, s.sufficiency, self.cfg.alpha)}
        if "mist_clipped" in self.cfg.methods:  # from the same per-layer terms
            clipped = [eq7(p, s.layer_weights, "clipped")
                       for p in (s.necessity_per_layer, s.sufficiency_per_layer)]
            scores["mist_clipped"] = combine(*clipped, self.cfg.alpha)
        scores.update({n: r.scores for n, r in scored.items() if n != "mist"})
        scores.update({n: positional_scores(enc.chain_len, n) for n in POSITIONAL})
        out = {}
        if "greedy_ll" in self.cfg.methods:
            from mist_core.measures.evaluation import greedy_likelihood

            for g, kept in greedy_likelihood(self.lm, enc, self.cfg.budgets).items():
                out[variant_name("greedy_ll", g)] = kept
        for name in self.cfg.methods:
            if name == "full":
                out[name] = np.ones(enc.chain_len, dtype=bool)
            elif name == "nochain":
                out[name] = NOCHAIN
            elif name in scores:
                for c in prune_scores(enc.example, scores[name], enc.chain_offsets,
                                      self.cfg.budgets, self.cfg.unit):
                    out[variant_name(name, c.budget)] = c.kept
        return out

    def _exact(self, enc, s) -> dict:
        """First-order (the scoring above) vs exact interventions at the chosen layers."""
        from mist_core.measures.stats import exact_agreement
        from mist_core.scoring.exact import exact_scores_encoded

        layers = self.exact_layers
        nec, suf = exact_scores_encoded(self.lm, enc, layers=layers)
        rows = np.asarray(layers) - 1  # the scorer keeps every block, 1..L
        w = s.layer_weights[rows]
        return {"layers": layers,
                "necessity": exact_agreement(s.necessity_per_layer[rows], nec, (0.3, 0.5), w),
                "sufficiency": exact_agreement(s.sufficiency_per_layer[rows], suf, (0.3, 0.5), w)}


# ---------------------------------------------------------------- the driver

def plan_rows(batch: pa.Table, *, adapter: str, columns: dict) -> pa.Table:
    """Each raw row's id and chain length in characters (null for an invalid row), with
    the job's own parsing and validation."""
    keys, lengths = [], []
    for raw in batch.column("raw").to_pylist():
        try:
            ex, _ = parse_row(raw, adapter, columns)
            keys.append(ex.key)
            lengths.append(len(ex.cot))
        except InvalidExample:
            keys.append(None)
            lengths.append(None)
    return pa.table({"source": batch.column("source"), "row": batch.column("row"),
                     "key": pa.array(keys, pa.string()), "chars": pa.array(lengths, pa.int64())})


def choose(plan: pa.Table, sample: int, seed: int, exact_n: int) -> tuple[dict, int]:
    """The sample: `sample` distinct valid rows drawn with `seed` (all of them if fewer),
    and among them `exact_n` for exact interventions, drawn from the shortest quarter
    (exact interventions cost T passes of up to L blocks over T tokens per chain). Returns
    {(source, row): exact?} and the number of valid distinct rows."""
    rows = sorted(zip(*(plan.column(c).to_pylist() for c in ("source", "row", "key", "chars"))))
    seen, valid = set(), []
    for source, row, key, chars in rows:
        if key is not None and key not in seen:
            seen.add(key)
            valid.append((source, row, chars))
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(valid), size=min(sample, len(valid)), replace=False).tolist())
    chosen = [valid[i] for i in pick]
    exact = set()
    if exact_n and chosen:
        q1 = float(np.percentile([c for _, _, c in chosen], 25))
        short = [i for i, (_, _, c) in enumerate(chosen) if c <= q1]
        exact = set(np.random.default_rng(seed + 1).choice(
            short, size=min(exact_n, len(short)), replace=False).tolist())
    return {(s, r): i in exact for i, (s, r, _) in enumerate(chosen)}, len(valid)


def select_rows(batch: pa.Table, *, wanted: dict) -> pa.Table:
    rows = [r for r in batch.to_pylist() if (r["source"], r["row"]) in wanted]
    return pa.table({"source": pa.array([r["source"] for r in rows], pa.string()),
                     "row": pa.array([r["row"] for r in rows], pa.int64()),
                     "raw": pa.array([r["raw"] for r in rows], pa.binary()),
                     "exact": pa.array([wanted[(r["source"], r["row"])] for r in rows], pa.bool_())})


def load_done(out: Path, cfg: EvalConfig) -> set:
    """Ids already evaluated by an earlier run with the same settings (mode resume)."""
    run, results = out / RUN, out / RESULTS
    if cfg.mode == "overwrite":
        for p in (run, results, out / (RESULTS + ".gz")):
            p.unlink(missing_ok=True)
        return set()
    packed = out / (RESULTS + ".gz")
    if not results.exists() and packed.exists():  # published results are stored gzipped
        import gzip
        import shutil

        with gzip.open(packed, "rb") as src, results.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    if not results.exists():
        return set()
    before = json.loads(run.read_text())["config"] if run.exists() else {}
    now = cfg.to_dict()
    diff = [k for k in _SAME if k in before and json.dumps(before[k]) != json.dumps(now[k])]
    if diff:
        raise ConfigError(f"{out} holds results made with other settings ({', '.join(diff)}); "
                          "use --mode overwrite or another --output")
    return {(rec["source"], rec["row"]) for rec in read_records(results)}


def run(cfg: EvalConfig, argv: list[str]) -> dict:
    from mist_core.models import check_reachable, resolve

    t0 = time.perf_counter()
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    try:
        inputs = resolve_inputs(cfg.input, cfg.format)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:  # a bad --model or template fails here, before Ray starts
        check_reachable(cfg.model)
        _, model_name = resolve(cfg.model)
        template_for(cfg.model, cfg.template)
    except (OSError, ValueError) as e:
        raise ConfigError(one_line(f"cannot load the tokenizer of --model {cfg.model}: {e}")
                          ) from None
    done = load_done(out, cfg)
    runtime.init_ray(cfg.address, cfg.actors, cfg.cpus_per_actor, cfg.verbose)

    plan = read_raw(inputs).map_batches(plan_rows, batch_format="pyarrow",
                                        fn_kwargs={"adapter": cfg.adapter, "columns": cfg.columns})
    plan = pa.concat_tables(list(plan.iter_batches(batch_format="pyarrow", batch_size=None)))
    wanted, n_valid = choose(plan, cfg.sample, cfg.seed, cfg.exact_n)
    todo = {k: v for k, v in wanted.items() if k not in done}
    meta = {"config": cfg.to_dict(), "model_name": model_name,
            "command": "mist eval " + shlex.join(argv),
            "corpus_rows": plan.num_rows, "corpus_valid": n_valid, "sample": len(wanted),
            "exact_rows": sum(wanted.values()), "token_types": list(TYPES),
            "versions": runtime.versions()}
    log.info("%d rows read, %d valid; sample %d (%d for exact interventions); %d to evaluate",
             plan.num_rows, n_valid, len(wanted), meta["exact_rows"], len(todo))
    (out / RUN).write_text(json.dumps({**meta, "status": "running"}, indent=2) + "\n")

    gpus = runtime.gpus_per_actor(cfg.gpus_per_actor)
    n, t_run = 0, time.perf_counter()
    if todo:
        rows = read_raw(inputs).map_batches(select_rows, batch_format="pyarrow",
                                            fn_kwargs={"wanted": todo})
        rows = pa.concat_tables(list(rows.iter_batches(batch_format="pyarrow", batch_size=None)))
        # One block per actor call: a map task hands its output on only when its input
        # block is done, so small blocks are what lets each record reach the file at once.
        bs = cfg.batch_size
        ds = ray.data.from_arrow([rows.slice(i, bs) for i in range(0, rows.num_rows, bs)])
        ds = ds.map_batches(EvalActor, compute=runtime.actor_pool(cfg.actors), batch_size=cfg.batch_size,
                            batch_format="pyarrow", fn_constructor_kwargs={
                                "cfg": cfg, "device": "cuda" if gpus else "cpu"},
                            **runtime.actor_resources(cfg.cpus_per_actor, gpus))
        with (out / RESULTS).open("a", encoding="utf-8") as f:
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                for line in batch.column("record").to_pylist():
                    f.write(line + "\n")
                    n += 1
                f.flush()
                os.fsync(f.fileno())
                dt = time.perf_counter() - t_run
                log.info("%d/%d chains in %.0fs (%.1f s/chain, about %.0f min left)", n,
                         len(todo), dt, dt / n, (len(todo) - n) * dt / n / 60)
    meta.update(status="done", seconds={"total": time.perf_counter() - t0,
                                        "evaluate": time.perf_counter() - t_run,
                                        "chains_this_run": n})
    (out / RUN).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


EPILOG = """\
examples:
  mist eval --input ../shared/data/gsm8k/test.jsonl --adapter gsm8k \\
      --sample 200 --output docs/results/runs/gsm8k
  mist report docs/results/runs/gsm8k --out docs/results
"""


def parse_args(argv: list[str] | None, prog: str) -> EvalConfig:
    """The evaluation's settings from its command line (and the YAML file --config names)."""
    return parse(EvalConfig, argv, prog, __doc__.split("\n\n")[0], EPILOG)


def main(argv: list[str] | None = None, prog: str = "mist eval") -> int:
    """`mist eval`: score, prune and measure each method at each budget, then print the table.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for bad settings, input or a model that cannot load, 4 for
        storage that stayed unavailable (pipelines.common.exits)."""
    exits.setup_logging()
    argv = sys.argv[1:] if argv is None else list(argv)

    def body() -> int:
        cfg = parse_args(argv, prog)
        from .report import console_table

        with runtime.console(cfg.verbose):
            meta = run(cfg, argv)
        print(f"evaluated {meta['seconds']['chains_this_run']} chains in "
              f"{meta['seconds']['total']:.0f}s; results in {cfg.output}/{RESULTS}\n")
        print(console_table(cfg.output), end="", flush=True)
        return 0

    return exits.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
