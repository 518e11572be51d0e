"""The job under a memory cap: `--max-memory` reaches the scoring actors, a chain that cannot
fit alone becomes a `too_long_for_memory` reject with its length and the cap, and the rest
are scored exactly as without a cap."""
import json

import pytest

from mist_core import Example, MistScorer, load_model
from pipelines.job import compress
from pipelines.common import storage

pytestmark = pytest.mark.integration  # the job on a local Ray


def read_dir(out, sub):
    fs, root, _ = storage.filesystem(str(out / sub))
    table = storage.read_parquet_dir(fs, root)
    return [] if table is None else table.to_pylist()


def test_max_memory_rejects_only_what_cannot_fit_alone(local_ray, model_dir, tmp_path):
    words = "She has 16 eggs and eats 3 so 13 are left over today."
    rows = [{"id": f"r{i}", "question": "How many eggs are left?", "cot": words, "answer": "13"}
            for i in range(4)]
    rows.append({"id": "long", "question": "How many eggs are left?",
                 "cot": " ".join([words] * 8), "answer": "13"})
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The cap: room for a short chain, not for the long one even with recomputation.
    scorer = MistScorer(load_model(str(model_dir)))
    encs = [scorer.encode(Example(r["question"], r["cot"], r["answer"], id=r["id"])) for r in rows]
    cap = int(1.5 * scorer.need([encs[0]], scorer.plans()[0]))
    assert min(scorer.need([encs[-1]], plan) for plan in scorer.plans()) > cap

    out = tmp_path / "out"
    argv = ["--input", str(corpus), "--output", str(out), "--model", str(model_dir),
            "--budgets", "0.5", "--max-memory", str(cap), "--scores"]
    assert compress.main(argv) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (5, 4, 1)
    assert c["rejected_by_reason"] == {"too_long_for_memory": 1}
    assert manifest["config"]["max_memory"] == cap
    [reject] = read_dir(out, "rejects")
    assert reject["id"] == "long" and reject["reason"] == "too_long_for_memory"
    assert f"{scorer.batch_length(encs[-1])} tokens" in reject["detail"]
    assert "max_memory" in reject["detail"]
    uncapped = {s.id: s.scores for s in MistScorer(load_model(str(model_dir))).score_encoded(encs[:4])}
    for row in read_dir(out, "scores"):
        assert row["scores"] == pytest.approx(list(uncapped[row["id"]]), abs=1e-4)


def test_cpu_model_actors_start_with_huge_page_allocation(local_ray, monkeypatch):
    """A CPU model actor's process starts with mist_core.scoring.allocator.CPU_SCORING_ENV, so
    torch's first allocation already reads it: a large CPU tensor's mapping is advised to take
    huge pages (`hg` among its VmFlags in /proc/self/smaps; the flag comes from a kernel with
    transparent huge pages, as Linux distributions build it)."""
    import ray

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # the driver's value would win

    from mist_core.scoring import allocator
    from pipelines.common import runtime

    class Probe:  # defined here so that Ray ships it by value
        def __call__(self, batch):
            import os

            import torch

            t = torch.empty(8 * 2**20, dtype=torch.uint8)
            ptr, inside, advised = t.data_ptr(), False, False
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split()[0]
                    if "-" in head and all(c in "0123456789abcdef-" for c in head):
                        lo, hi = (int(x, 16) for x in head.split("-"))
                        inside = lo <= ptr < hi
                    elif head == "VmFlags:" and inside:
                        advised = "hg" in line.split()[1:]
            n = len(batch["id"])
            return {"env": [os.environ.get("THP_MEM_ALLOC_ENABLE")] * n, "advised": [advised] * n}

    probe = ray.data.range(2).map_batches(Probe, compute=ray.data.ActorPoolStrategy(size=1),
                                          **runtime.actor_resources(1, 0))
    rows = probe.take_all()
    assert len(rows) == 2
    assert all(r["env"] == allocator.CPU_SCORING_ENV["THP_MEM_ALLOC_ENABLE"] for r in rows)
    assert all(r["advised"] for r in rows)
    assert "runtime_env" not in runtime.actor_resources(1, 1)  # a GPU actor as before
