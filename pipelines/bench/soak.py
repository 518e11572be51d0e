"""Soak run: many short chains through the real compression job (its own local Ray, in a
subprocess) with a tiny random model, sampling the memory of the driver and of every Ray
worker while it runs. The figures behind docs/results/reliability.md.

    mist soak                       # 20,000 chains + 1% malformed rows
    mist soak --chains 2000 --json outputs/soak.json

The model has SmolLM2's tokenizer and a 2-layer random body: scoring is cheap, so the run
stresses what surrounds it (reading, tokenizing, the actor's batches, writing, accounting).
Memory is each process's own resident pages (USS: driver, scoring actor, other Ray workers,
all), and the actor's RSS besides; growth is the median over the last fifth of a process's
samples minus that over the second fifth (after warm-up)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from ..common import exits
from ..common.settings import Kit, parse, positive, setting

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(path: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mist_core.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct")[0],
                                              trust_remote_code=False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def corpus(path: Path, n: int, bad_every: int) -> tuple[int, int]:
    """n demo rows, plus one malformed line after every `bad_every` rows (0: none)."""
    from mist_core.data.demo import demo_corpus

    bad = 0
    with open(path, "w") as f:
        for i, row in enumerate(demo_corpus(n, seed=7)):
            row["id"] = f"soak-{i}"
            f.write(json.dumps(row) + "\n")
            if bad_every and (i + 1) % bad_every == 0:
                f.write('{"question": "cut off' if bad % 2 else json.dumps({"question": "no chain"}))
                f.write("\n")
                bad += 1
    return n, bad


class Sampler(threading.Thread):
    """Memory of a process and all its descendants every `every` seconds: each process's
    own pages (USS) and, for the scoring actor, also its RSS, which counts the pages of Ray's
    shared object store it has read and so grows with the data that passed through it."""

    def __init__(self, pid: int, every: float = 1.0):
        super().__init__(daemon=True)
        self.root, self.every, self.samples, self.stop = psutil.Process(pid), every, [], threading.Event()

    def run(self):
        t0 = time.monotonic()
        while not self.stop.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            sample = {"t": time.monotonic() - t0, "driver": 0, "actor": 0, "actor_rss": 0,
                      "workers": 0, "total": 0}
            for p in procs:
                try:
                    mem = p.memory_full_info()
                    title = " ".join(p.cmdline())
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                own = mem.uss / 2**20
                sample["total"] += own
                if p.pid == self.root.pid:
                    sample["driver"] = own
                elif "ScoreActor" in title:
                    sample["actor"] = max(sample["actor"], own)
                    sample["actor_rss"] = max(sample["actor_rss"], mem.rss / 2**20)
                elif title.startswith("ray::"):
                    sample["workers"] += own
            self.samples.append(sample)
            self.stop.wait(self.every)


def summarise(samples: list[dict], key: str) -> dict:
    """Peak MiB, and the median in each fifth of the samples where the process was alive."""
    values = [s[key] for s in samples if s[key] > 0]
    if len(values) < 10:
        return {"peak_mb": max(values, default=0.0)}
    n = len(values)
    fifths = [statistics.median(values[i * n // 5:(i + 1) * n // 5]) for i in range(5)]
    return {"peak_mb": max(values), "median_mb_by_fifth": fifths,
            "growth_mb": fifths[-1] - fifths[1]}


class SoakConfig(Kit):
    """`mist soak`'s settings."""

    chains: int = setting(20000, "chains in the generated corpus", group="input", metavar="N")
    bad_every: int = setting(100, "a malformed line after every N rows", group="input",
                             metavar="N")
    batch_size: int = setting(64, "the job's --batch-size", group="resources", metavar="N")
    json_path: str | None = setting(None, "write the figures here too", group="output",
                                    metavar="FILE", shown="", flag="json")

    _positive = positive("chains", "bad_every", "batch_size")


def main(argv: list[str] | None = None, prog: str = "mist soak") -> int:
    """`mist soak`: the job on a large generated corpus, its memory sampled throughout.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0 when every row is accounted for, 1 when not, 2 for bad settings."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return exits.run_main(lambda: soak(parse(SoakConfig, argv, prog, __doc__), argv, prog))


def soak(args: SoakConfig, argv: list[str], prog: str) -> int:
    with tempfile.TemporaryDirectory(prefix="mist-soak-") as tmp:
        tmp = Path(tmp)
        model = tiny_model(tmp / "tiny-smollm2")
        good, bad = corpus(tmp / "corpus.jsonl", args.chains, args.bad_every)
        out = tmp / "out"
        cmd = [sys.executable, "-m", "pipelines.compress", "--input", str(tmp / "corpus.jsonl"),
               "--output", str(out), "--model", str(model), "--batch-size", str(args.batch_size)]
        t0 = time.monotonic()
        with open(tmp / "job.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            sampler = Sampler(proc.pid)
            sampler.start()
            rc = proc.wait()
            sampler.stop.set()
            sampler.join()
        wall = time.monotonic() - t0
        if rc != 0:
            print((tmp / "job.log").read_text()[-5000:], file=sys.stderr)
            print(f"soak: the job exited with {rc}", file=sys.stderr)
            return 1
        manifest = json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    result = {
        "command": " ".join([prog] + argv),
        "rows_written": good + bad, "good_rows": good, "malformed_rows": bad,
        "read": c["read"], "scored": c["scored"], "rejected": c["rejected"],
        "rejected_by_reason": c["rejected_by_reason"], "reconciled": c["read"] == c["scored"] + c["rejected"] + c["already_done"],
        "wall_s": wall, "run_s": manifest["timings"]["run_s"],
        "chains_per_s": manifest["throughput"]["chains_per_s"],
        "samples": len(sampler.samples),
        "memory": {k: summarise(sampler.samples, k)
                   for k in ("driver", "actor", "actor_rss", "workers", "total")},
    }
    print(json.dumps(result, indent=2))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["reconciled"] and c["scored"] == good and c["rejected"] == bad else 1


if __name__ == "__main__":
    sys.exit(main())
