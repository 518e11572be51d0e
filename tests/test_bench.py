import json

import pytest

from mist_core.scoring.tracing import length_batches, similar_lengths
from pipelines.bench import scorer as bench
from pipelines.cli import main as mist


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert mist(["bench", "--smoke", "--json", str(out)]) == 0  # as `mist bench --smoke`
    r = json.loads(out.read_text())
    assert r["chains"] == 16 and r["forward_equivalents"] > 0 and r["chains_per_s"] > 0
    assert 0 <= r["padding_share"] < 0.5
    assert r["exact_over_first_order"] > 0  # a ratio of timings: reported, not asserted
    assert "forward-equivalents" in capsys.readouterr().out


def test_batching_helpers():
    lengths = [100, 10, 12, 101, 50, 11]
    batches = length_batches(lengths, max_tokens=240, max_batch=8)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 240
    groups = similar_lengths(lengths, waste=0.05)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        width = max(lengths[i] for i in g)
        assert width * len(g) - sum(lengths[i] for i in g) <= 0.05 * width * len(g)


def _padded_cost(batches, lengths, overhead):
    return sum(len(b) * max(lengths[i] for i in b) + overhead for b in batches)


def _every_cut(order):
    """Every way of cutting `order` into consecutive batches."""
    import itertools

    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        bounds = [0] + [k + 1 for k, cut in enumerate(cuts) if cut] + [len(order)]
        yield [order[a:b] for a, b in zip(bounds, bounds[1:])]


def test_length_batches_cut_where_padding_and_batches_cost_least():
    """Against every way of cutting the sorted lengths into batches that fit: none costs
    less (padded positions plus the overhead of each batch)."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 9))]
        max_tokens, max_batch, overhead = rng.randint(60, 200), rng.randint(1, 5), rng.randint(0, 80)

        def fits(b):
            return len(b) <= max_batch and (len(b) == 1
                                            or len(b) * max(lengths[i] for i in b) <= max_tokens)

        got = length_batches(lengths, max_tokens, max_batch, overhead)
        assert sorted(i for b in got for i in b) == list(range(len(lengths)))
        assert all(fits(b) for b in got)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(_padded_cost(bs, lengths, overhead) for bs in _every_cut(order)
                   if all(fits(b) for b in bs))
        assert _padded_cost(got, lengths, overhead) == best


def test_length_batches_split_where_padding_costs_more_than_a_batch():
    lengths = list(range(33, 91))  # a spread like the shortest GSM8K chains'
    filled = length_batches(lengths, max_tokens=8192, max_batch=64, overhead=10**9)
    assert len(filled) == 1  # a batch costs more than any padding: one batch
    cut = length_batches(lengths, max_tokens=8192, max_batch=64, overhead=96)
    assert len(cut) > 1
    assert _padded_cost(cut, lengths, 96) < _padded_cost(filled, lengths, 96)
    assert length_batches([50] * 10, 4096, 64, overhead=1) == [list(range(10))]  # no padding


def test_synthetic_chains_are_consistent():
    for e in bench.synthetic_encoded(5, 30, vocab=100):
        assert e.answer_stop == len(e.source_ids) and e.chain_stop + 4 == e.answer_start
        assert list(e.target_ids[e.target_final + 1:]) == list(e.source_ids[e.answer_start:])
        assert list(e.target_ids[:e.chain_start]) == list(e.source_ids[:e.chain_start])


@pytest.mark.integration
def test_pipeline_over_bare_runs_the_job_on_the_same_chains(tmp_path, model_dir, no_ray):
    """The --pipeline measurement on a tiny model: both sides score every chain."""
    import ray

    from mist_core.data.demo import demo_corpus
    from pipelines.bench.pipeline import pipeline_over_bare

    corpus = tmp_path / "gsm8k.jsonl"
    corpus.write_text("".join(json.dumps({"question": r["question"],
                                          "answer": f'{r["cot"]}\n#### {r["answer"]}'}) + "\n"
                              for r in demo_corpus(12, seed=3)))
    assert not ray.is_initialized()
    args = bench.parse(["--model", str(model_dir), "--corpus", str(corpus), "--chains", "12",
                        "--pipeline", "--threads", "1", "--batch-size", "4", "--repeats", "1"])
    r = pipeline_over_bare(args)
    assert r["pipeline_chains"] == 12
    assert r["bare_s"] > 0 and r["job_s"] > r["job_run_s"] > 0
    assert r["pipeline_repeats"] == 1 and r["pipeline_over_bare"] == r["bare_s"] / r["job_s"] > 0
    assert not ray.is_initialized()


def test_a_sweep_cut_off_keeps_the_lengths_it_finished(tmp_path, monkeypatch):
    """A GPU run cut by `timeout` lost every length when the JSON was written only at the end."""
    from pipelines.bench import long

    def fake_run(spec, python, env):
        if spec["tokens"] == 192:
            raise KeyboardInterrupt  # what the time limit does to the sweep
        return {"forward_equivalents": 3.0, "score_s": 3.0, "forward_s": 1.0,
                "score_s_per_1k_tokens": 1.0, "peak_over_model_bytes": 1, "model_bytes": 2}

    monkeypatch.setattr(long, "_run", fake_run)
    out = tmp_path / "sweep.json"
    assert mist(["bench", "--sweep", "96,192", "--model", "random:tiny", "--json", str(out)]) == 130
    r = json.loads(out.read_text())
    assert [row["chain_tokens"] for row in r["sweep"]] == [96]
    assert r["sweep"][0]["forward_equivalents"] == 3.0


@pytest.mark.integration
def test_length_sweep_measures_each_length_in_its_own_processes(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert mist(["bench", "--sweep", "96", "--model", "random:tiny", "--repeats", "1",
                 "--threads", "1", "--max-memory", "64MB", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["chain_tokens"] for row in r["sweep"]] == [96]
    for row in r["sweep"]:
        assert not [k for k in row if k.endswith("_error")], row
        assert row["forward_equivalents"] > 0 and row["score_s"] > 0
        assert row["forward_equivalents_cpu"] > 0 and len(row["score_cpu_runs"]) == 1
        assert row["forward_equivalents_fastest"] == min(row["score_runs"]) / min(row["forward_runs"])
        f, (sc,) = row["forward_runs"], row["score_runs"]  # forward, score, forward
        assert len(f) == 2 and row["forward_equivalents_paired"] == sc / ((f[0] + f[1]) / 2)
        assert 0 <= row["stolen_share"] <= 1  # this machine's /proc/stat has the steal column
        assert row["score_peak_over_model_bytes"] >= 0 and row["model_bytes"] > 0
        assert row["recompute"] is False  # 64MB holds a tiny model's stored pass
    assert r["max_memory"] == "64MB"
    assert "forwards" in capsys.readouterr().out
