"""Fixtures: tiny random-initialised Llama/Qwen2/Mistral models and a byte-level BPE
tokenizer trained in the test session, so the fast tests need no download."""
from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test models are tiny: a second intra-op thread only adds synchronisation, and on a busy
# 2-core machine every op then waits for a time slice (test_eq1_and_greedy_match_plain_computations:
# 58 s with 2 threads, 1.2 s with 1). Only this process: Ray workers and job subprocesses set theirs.
torch.set_num_threads(1)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "Janet has 16 eggs. She eats 3 and bakes with 4, so she sells 16 - 3 - 4 = 9 eggs.",
    "She makes 9 * 2 = 18 dollars every day at the market. The answer is 18.",
    "Question: how many apples are left? Answer: there are 12 - 5 = 7 apples left.",
    "Therefore the total cost is 3 + 4 + 5 = 12 and each friend pays 12 / 3 = 4.",
    "If x = 2 then 2x + 1 = 5, so the value of the expression is 5.",
    "Tom runs 5 miles a day for 7 days, which is 35 miles a week in total.",
]


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Drops zero-width spaces, so that a text made of them tokenizes to nothing.
    tok.normalizer = normalizers.Replace("\u200b", "")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def make_model(arch: str, vocab: int, dtype=torch.float32, layers: int = 4, seed: int = 0):
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                              Qwen3Config)

    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
              "qwen3": Qwen3Config}[arch](**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    # Random init gives near-uniform logits; larger weights make the answer depend on the
    # chain so that scores are far from zero and comparisons mean something.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama (context 256) and its tokenizer, saved so that Ray workers and
    job subprocesses can load it by path."""
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    make_model("llama", len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


REMOTE_CODE = """\
import os, pathlib
pathlib.Path(os.environ["MIST_TEST_MARKER"]).write_text("remote code ran")
from transformers import LlamaConfig


class EvilConfig(LlamaConfig):
    model_type = "evilllama"
"""


@contextlib.contextmanager
def model_with_code(path, tokenizer, monkeypatch):
    """A model folder at `path` whose config is custom Python (auto_map) that leaves a marker
    file when imported; yields (path, marker). The marker's path and the modules cache are
    in the environment, so that a command run as a subprocess inherits them. transformers
    imports a folder's code as a module named after the folder, once a process: give each
    test file its own folder name, or a second trusted load would not run the code again."""
    import json

    from pipelines.common import rows

    make_model("llama", len(tokenizer), layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="evilllama", auto_map={"AutoConfig": "evil_config.EvilConfig"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "evil_config.py").write_text(REMOTE_CODE)
    marker = path.parent / "marker"
    monkeypatch.setenv("MIST_TEST_MARKER", str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(path.parent / "modules"))
    rows.template_for.cache_clear()
    yield path, marker
    rows.template_for.cache_clear()


def _start_loopback_ray() -> None:
    """A local Ray with 2 CPUs on the loopback address. Ray swaps 127.0.0.1 for the machine's
    outward address unless told the cluster is single-machine (the flag is read at import,
    hence the patch, undone when this Ray stops)."""
    import ray
    from ray._private import ray_constants

    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 _node_ip_address="127.0.0.1")
        assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    except BaseException:
        patch.undo()
        raise
    _RAY_PATCH.append(patch)


_RAY_PATCH: list = []  # the running loopback Ray's patch, undone when it stops


def stop_loopback_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    while _RAY_PATCH:
        _RAY_PATCH.pop().undo()


@pytest.fixture
def no_ray():
    """For a test of code that starts and stops Ray itself: the shared loopback Ray, if an
    earlier module of this xdist worker left it up, is stopped first."""
    stop_loopback_ray()
    yield


@pytest.fixture(scope="module")
def local_ray():
    """The loopback Ray the in-process job tests share: started by the first test that asks
    for it and kept for the rest of the session (of each xdist worker), not started again for
    each module. A module whose workers must inherit variables (the S3 ones) takes its own
    with `loopback_ray`; a test whose error path shuts Ray down (exits.run_main) leaves the
    next module to start it again."""
    import ray

    if not ray.is_initialized():
        _start_loopback_ray()
    yield


@pytest.hookimpl(trylast=True)  # after pytest groups the tests by their parametrized fixtures
def pytest_collection_modifyitems(items):
    """The files with end-to-end tests first: xdist hands out whole files in this order (make
    test: --dist loadfile --no-loadscope-reorder; xdist's own order puts the files with the
    most tests first, the many small unit tests, and the long single job runs last), so the
    long runs start at once and the unit-test files fill the end. A stable sort."""
    heavy = {item.path for item in items if item.get_closest_marker("integration")}
    items.sort(key=lambda item: item.path not in heavy)


def pytest_sessionfinish(session, exitstatus):
    if "ray" in sys.modules:
        stop_loopback_ray()


@contextlib.contextmanager
def loopback_ray():
    """A loopback Ray of the caller's own, started after the variables its workers must
    inherit are set (the shared one, if up, is stopped first) and stopped on leaving."""
    stop_loopback_ray()
    _start_loopback_ray()
    try:
        yield
    finally:
        stop_loopback_ray()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_lm(request, tokenizer):
    from mist_core.models import wrap_model

    return wrap_model(make_model(request.param, len(tokenizer)), tokenizer, f"tiny-{request.param}")


def committed(folder: Path) -> list[Path]:
    """A job output folder's finished parquet files, as pyarrow and Ray read a folder: not a
    `_tmp-` file a write in progress (or a stopped run) left."""
    return sorted(f for f in folder.glob("*.parquet") if not f.name.startswith("_"))


def partial_files(out: Path) -> list[str]:
    """What a stopped run can leave (Output.clean_partial's list): `_tmp-` files, and sft/
    and scores/ files without their data/ file (the data/ file commits its group)."""
    stems = {f.stem for f in committed(out / "data")} | {"empty"}  # ensure_files' placeholder
    return sorted(f"{d}/{f.name}" for d in ("data", "sft", "scores", "rejects")
                  for f in (out / d).glob("*")
                  if f.name.startswith("_tmp-") or (d in ("sft", "scores") and f.stem not in stems
                                                    and not f.name.startswith((".", "_"))))


def job_in_process(cmd: list[str]) -> dict:
    """A job command line (`python -m pipelines.compress ...` or `mist compress ...`) run in
    this process, on the Ray it shares (the `local_ray` fixture): its manifest. The same
    settings as the command run as a subprocess, without the ~40 CPU-seconds a subprocess
    spends starting its own Ray and importing torch again; for the runs where no process is
    killed or read from the console. The fault variables set here reach the scoring actors
    (runtime.actor_resources)."""
    from pipelines.job import compress

    start = 3 if cmd[1:3] == ["-m", "pipelines.compress"] else 2
    assert start == 3 or cmd[:2] == ["mist", "compress"], cmd
    return compress.run(compress.parse_args(cmd[start:]))


def counted_applies(monkeypatch, function) -> list:
    """A list that gets one entry for each call of the autograd Function's `apply`."""
    seen = []
    apply = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: seen.append(1) or apply(*a))
    return seen


def _rmsnorm_fp64(self, x):
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def full_precision_norms(model):
    """transformers' RMSNorm computes in fp32 whatever the input dtype, which caps an fp64
    model at fp32 precision; the convergence tests need real fp64 throughout."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm_fp64, module)
    return model


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_lm64(request, tokenizer):
    from mist_core.models import wrap_model

    model = full_precision_norms(make_model(request.param, len(tokenizer), dtype=torch.float64))
    return wrap_model(model, tokenizer, f"tiny-{request.param}-fp64")


@pytest.fixture
def examples():
    from mist_core import Example

    return [
        Example("Janet has 16 eggs and eats 3. How many are left?",
                "She has 16 eggs. She eats 3, so 16 - 3 = 13 eggs are left.", "13", id="a"),
        Example("Tom runs 5 miles a day. How far in 7 days?",
                "Each day is 5 miles. Over 7 days that is 5 * 7 = 35 miles.", "35", id="b"),
        Example("What is 2x + 1 when x = 2?", "If x = 2 then 2x + 1 = 5.", "5", id="c"),
    ]
