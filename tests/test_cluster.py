"""The job on a cluster's shape, on one machine: Ray's own `cluster_utils.Cluster` with a
CPU-only head and two worker nodes that declare one GPU each. The job joins it (--address),
places its scoring actors on the GPUs (--gpus-per-actor 1) but runs the model on the CPU
(--device cpu), and one worker node is removed part-way through the run. The CPU stages
(reading, tokenizing, pruning, writing) go wherever there are CPUs: the head's and the
worker nodes' beside their actors."""
from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from conftest import committed
from test_faults import assert_exactly_once, corpus

pytestmark = pytest.mark.integration  # a three-node Ray cluster on this machine

BUDGETS = "0.5,0.8"  # as test_faults' assert_exactly_once expects


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU, no GPU) and two workers (2 CPUs, 1 GPU each), all on the loopback
    address and in a temp dir of their own. Cluster would also write its address to
    /tmp/ray/ray_current_cluster (where `ray.init()` and the ray CLI look for the current
    cluster) and delete it at shutdown: patched out, to leave any other Ray on the
    machine alone."""
    import ray
    import ray._common.utils
    import ray._private.utils
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from conftest import stop_loopback_ray

    stop_loopback_ray()  # the job must join this cluster, not a Ray an earlier module left up
    with pytest.MonkeyPatch.context() as mp:
        # The node processes inherit these: single-machine (loopback) nodes, and scoring
        # batches slow enough that the run is still going when a node is removed.
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setenv("MIST_FAULT_SLEEP_S", "0.3")
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        mp.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
        mp.setattr(ray._common.utils, "reset_ray_address", lambda *a, **k: None)
        temp = tempfile.mkdtemp(prefix="mistcl-", dir="/tmp")  # short: Ray puts sockets in it
        node = {"node_ip_address": "127.0.0.1", "temp_dir": temp}
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "include_dashboard": False, **node})
        try:
            workers = [c.add_node(num_cpus=2, num_gpus=1, **node) for _ in range(2)]
            c.wait_for_nodes()
            yield SimpleNamespace(cluster=c, address=c.address, head=c.head_node.node_id,
                                  workers=workers)
        finally:
            ray.shutdown()
            c.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def argv(corpus_path: Path, out: Path, model_dir: Path, address: str, *extra) -> list[str]:
    return ["--input", str(corpus_path), "--output", str(out), "--model", str(model_dir),
            "--budgets", BUDGETS, "--unit", "token", "--address", address,
            "--gpus-per-actor", "1", "--actors", "1,2", "--batch-size", "2", *extra]


def test_gpu_placed_actors_survive_losing_a_worker_node(cluster, model_dir, tmp_path):
    import ray

    from pipelines.job import compress
    from pipelines.job import placement

    ids = corpus(tmp_path / "corpus.jsonl", 96)
    out = tmp_path / "out"
    worker_ids = {w.node_id for w in cluster.workers}
    lost: dict = {}

    def remove_a_scoring_node() -> None:
        """After the first committed file group: the worker node of a scoring actor that
        has scored, as the job's own records (placement.ActorStats) tell, goes away."""
        try:
            deadline = time.monotonic() + 240
            while not committed(out / "data"):
                assert time.monotonic() < deadline, "no committed data/ file after 240 s"
                time.sleep(0.05)
            [name] = [n for n in ray.util.list_named_actors()
                      if n.startswith(placement.STATS_NAME)]
            while True:  # the record of the batch in that file may still be on its way
                records = ray.get(ray.get_actor(name).all.remote())
                busy = {r["node_id"] for r in records if r["chains_scored"]}
                if busy:
                    break
                assert time.monotonic() < deadline, f"no actor reported a batch: {records}"
                time.sleep(0.05)
            node = next(w for w in cluster.workers if w.node_id in busy)
            lost.update(node=node.node_id, files=len(committed(out / "data")), records=records)
            cluster.cluster.remove_node(node)
            lost["removed_at"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 -- reported by the test below
            lost["error"] = e

    watcher = threading.Thread(target=remove_a_scoring_node, daemon=True)
    watcher.start()
    start = time.monotonic()
    rc = compress.main(argv(tmp_path / "corpus.jsonl", out, model_dir, cluster.address,
                            "--device", "cpu", "--rows-per-file", "16"))
    watcher.join(60)
    assert "error" not in lost, repr(lost.get("error"))
    assert rc == 0
    # The node went while rows were still to come: some groups were committed after it.
    assert "removed_at" in lost and lost["files"] < len(committed(out / "data")), lost
    manifest = json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (96, 96, 0)
    assert_exactly_once(out, ids)
    assert not [r for f in (out / "rejects").glob("*.parquet")
                for r in pq.read_table(f).to_pylist()]

    # (a) The scoring actors ran on the GPU nodes only, each with a GPU of its own, the
    # model on the CPU; after the loss, on the node that was left.
    assert manifest["model"]["device"] == "cpu" and manifest["config"]["device"] == "cpu"
    actors = manifest["actors"]
    nodes = {a["node_id"] for a in actors}
    assert nodes <= worker_ids and cluster.head not in nodes
    assert nodes == worker_ids  # the lost node's actor, and one on the other node
    for a in actors:
        assert a["device"] == "cpu" and a["node_ip"] == "127.0.0.1"
        assert len(a["accelerator_ids"]["GPU"]) == 1
        assert a["chains_scored"] >= 0 and a["busy_seconds"] >= 0
    assert lost["node"] in nodes
    # Every row was scored by some actor; a batch in flight on the lost node counts twice.
    assert sum(a["chains_scored"] for a in actors) >= 96
    print(f"job {time.monotonic() - start:.1f}s; node lost after {lost['files']} groups")


def test_device_cuda_on_a_gpu_that_torch_cannot_see_fails_clearly(cluster, model_dir,
                                                                 tmp_path, capsys):
    """The worker nodes declare GPUs that this machine does not have: --device cuda fails
    in the scoring actor, with exit status 2 and one line that says so."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: --device cuda would work")
    ids = corpus(tmp_path / "corpus.jsonl", 4)
    assert ids
    out = tmp_path / "out"
    from pipelines.job import compress

    rc = compress.main(argv(tmp_path / "corpus.jsonl", out, model_dir, cluster.address,
                            "--device", "cuda"))
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: --device cuda, but the scoring actor on node"), last
    assert "sees no CUDA device" in last and "--device cpu or auto" in last
    assert not (out / "_manifest.json").exists()
