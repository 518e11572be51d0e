"""`mist train`: fine-tune a model on the compression job's SFT records (TRL's SFTTrainer,
the loss on the completion only; full or LoRA, merged before saving) and save it as a model
folder that `mist generate`, `mist solve`, `mist compress` and `load_model` read: the third
step of the distillation loop (generate, compress, train, solve).

--workers 1 (the default) trains in this process, on the GPU where there is one.
--workers N runs the same training on N Ray Train workers (TorchTrainer, data parallel:
each worker trains on its shard of every batch, gradients averaged), a GPU each where the
cluster has GPUs; rank 0 saves the model as a Ray Train checkpoint, which is copied to
--output. On a cluster of several machines give --storage-path a location every node
reaches (s3://…, or a shared folder); by default checkpoints go to a temporary folder on
this machine, which is enough for one machine."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import field_validator

from . import base as loop
from ..common import runtime, storage
from ..common.errors import ConfigError
from ..common.settings import Ray, RemoteCode, auto_or, one_line, parse, positive, setting

TRAINING_OPTIONS = ("lora", "lora_rank", "epochs", "learning_rate", "batch_size", "max_length",
                    "seed", "log_every", "trust_remote_code")


def read_records(uris: list[str]) -> list[dict]:
    """The SFT records of every --sft (an output folder, its sft/, or files; local, s3://,
    gs://), in order, each checked to be one (before any model loads)."""
    from mist_core.distill.finetune import read_sft, record_turns

    records = []
    for uri in uris:
        try:
            fs, path, _ = storage.filesystem(uri)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            found = read_sft(path, filesystem=fs)
        except (ValueError, KeyError) as e:  # a file that is not JSONL or parquet
            raise ConfigError(one_line(f"cannot read SFT records from {storage.redact(uri)}: "
                                       f"{e}")) from None
        for i, rec in enumerate(found, 1):
            try:
                record_turns(rec)
            except ValueError as e:  # say, a corpus given where its compression output goes
                raise ConfigError(one_line(f"--sft {storage.redact(uri)}: record {i} is not "
                                           f"an SFT record: {e}")) from None
        records += found
    return records


def train_worker(config: dict) -> None:
    """One Ray Train worker: the same fine-tuning on its shard (the Trainer shards the data
    under torch.distributed); rank 0 saves and reports the model as the checkpoint."""
    import ray.train
    import torch

    from mist_core.distill.finetune import REPORT, finetune

    torch.set_num_threads(max(1, int(config["threads"])))
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory(prefix="mist-train-ckpt-") as tmp:
        finetune(config["model"], config["records"], tmp, **config["options"])
        if rank == 0:
            report = json.loads((Path(tmp) / REPORT).read_text())
            ray.train.report({"train_loss": report["train_loss"], "steps": report["steps"]},
                             checkpoint=ray.train.Checkpoint.from_directory(tmp))
        else:
            ray.train.report({})


def train_distributed(args: TrainConfig, records: list[dict], options: dict,
                      target: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    runtime.init_ray(args.address, (args.workers, args.workers), args.cpus_per_worker,
                     args.verbose)
    gpus = args.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if loop.cluster_gpus() > 0 else 0.0
    resources = {"CPU": args.cpus_per_worker, **({"GPU": gpus} if gpus else {})}
    scratch = None if args.storage_path else tempfile.mkdtemp(prefix="mist-train-runs-")
    print(f"training on {args.workers} Ray Train workers "
          f"({'GPU' if gpus else 'CPU'}, {resources})", flush=True)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"model": args.model, "records": records, "options": options,
                           "threads": args.cpus_per_worker},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=gpus > 0,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=f"mist-train-{time.strftime('%Y%m%dT%H%M%S')}",
                             storage_path=args.storage_path or scratch))
    try:
        result = trainer.fit()
        if result.checkpoint is None:
            raise RuntimeError("the Ray Train run reported no checkpoint")
        target.mkdir(parents=True, exist_ok=True)
        result.checkpoint.to_directory(str(target))
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def check_output(out: Path, overwrite: bool) -> None:
    """--output must be a new or empty folder, or, with --overwrite, a model `mist train`
    saved (its training.json): never a folder of other files, and never an earlier model
    replaced unasked."""
    from mist_core.distill.finetune import REPORT

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out} is a file: give a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    if not (out / REPORT).exists():
        raise ConfigError(f"--output {out} holds files that are not a model `mist train` "
                          "saved: give an empty or new folder")
    if not overwrite:
        raise ConfigError(f"--output {out} holds a model `mist train` saved earlier: give "
                          "--overwrite to replace it, or a new folder")


def replace_folder(stage: Path, out: Path) -> None:
    """The trained model in `stage` becomes `out`, the earlier model there (--overwrite)
    removed only once the new one is in place: no file of the two is ever mixed."""
    if out.exists() and any(out.iterdir()):
        old = stage.with_name(stage.name + "-old")
        os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)  # over an empty folder too


def run(args: TrainConfig) -> int:
    from mist_core.distill.finetune import REPORT, finetune

    t0 = time.perf_counter()
    out = Path(args.output)
    check_output(out, args.overwrite)
    records = read_records(args.sft)
    name = loop.check_model(args.model, args.trust_remote_code)
    options = {"lora": args.lora, "lora_rank": args.lora_rank, "epochs": args.epochs,
               "learning_rate": args.lr if args.lr is not None else (2e-4 if args.lora else 2e-5),
               "batch_size": args.batch_size, "max_length": args.max_length, "seed": args.seed,
               "log_every": args.log_every, "trust_remote_code": args.trust_remote_code}
    print(f"fine-tuning {name} on {len(records)} SFT records "
          f"({'LoRA rank ' + str(args.lora_rank) if args.lora else 'full'}, "
          f"lr {options['learning_rate']:g}, {args.epochs:g} epochs)", flush=True)
    # Trained beside --output, then moved there: a failed run leaves --output as it was.
    target = out.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = target.with_name(f".{target.name}.train-{uuid.uuid4().hex[:8]}")
    stage.mkdir()  # the umask's mode, as a plain folder would have (mkdtemp's is 0700)
    try:
        if args.workers == 1:
            finetune(args.model, records, stage, **options)
        else:
            train_distributed(args, records, options, stage)
        report = json.loads((stage / REPORT).read_text())
        report.update(model={"spec": args.model, "name": name},
                      sft=[storage.redact(u) for u in args.sft], workers=args.workers,
                      total_s=round(time.perf_counter() - t0, 3))
        (stage / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        replace_folder(stage, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    first = report["losses"][0]["loss"] if report["losses"] else float("nan")
    last = report["losses"][-1]["loss"] if report["losses"] else float("nan")
    print(f"trained {report['steps']} steps in {report['total_s']:.0f}s on {args.workers} "
          f"worker(s); loss {first:.3f} -> {last:.3f} (mean {report['train_loss']:.3f})")
    print(f"model: {out}  (mist solve --model {out} …)")
    return 0


class TrainConfig(Ray, RemoteCode):
    """`mist train`'s settings."""

    sft: list[str] = setting(..., "compression job output folders (their sft/ is read), sft/ "
                             "folders or files (JSONL or parquet; local, s3://, gs://)",
                             group="input", metavar="PATH", many=True)
    model: str = setting("smollm2-135m-instruct", "the model to fine-tune: hub id, local "
                         "folder, .gguf file or smollm2-135m-instruct", group="scoring",
                         metavar="SPEC")
    output: str = setting(..., "local folder for the trained model: new or empty, or with "
                          "--overwrite a model `mist train` saved there earlier",
                          group="output", metavar="DIR")
    overwrite: bool = setting(False, "replace the model an earlier `mist train` saved in "
                              "--output (once the new one is trained)", group="output")
    lora: bool = setting(False, "train LoRA adapters (merged when saved)", group="training")
    lora_rank: int = setting(16, "LoRA rank", group="training", metavar="R")
    epochs: float = setting(1.0, "epochs over the records", group="training", metavar="N")
    lr: float | None = setting(None, "learning rate (default: 2e-5, or 2e-4 with --lora)",
                               group="training", metavar="LR", shown="")
    batch_size: int = setting(8, "records per step per worker", group="training", metavar="N")
    max_length: int = setting(2048, "tokens per record, cut beyond", group="training",
                              metavar="N")
    seed: int = setting(0, "training seed", group="training")
    log_every: int = setting(10, "steps between logged losses", group="training", metavar="N")
    workers: int = setting(1, "1: train in this process; N: N Ray Train workers",
                           group="resources", metavar="N")
    cpus_per_worker: float = setting(1.0, "CPUs per Ray Train worker", group="resources",
                                     metavar="C")
    gpus_per_worker: float | None = setting(
        None, "GPUs per Ray Train worker (default: 1 where the cluster has GPUs)",
        group="resources", metavar="G", shown="")
    storage_path: str | None = setting(
        None, "where Ray Train keeps the checkpoint (s3://… or a shared folder on a "
        "multi-machine cluster; default: a temporary local folder)", group="resources",
        metavar="URI", shown="")

    _positive = positive("lora_rank", "batch_size", "log_every", "workers")
    _gpus = field_validator("gpus_per_worker", mode="before")(
        classmethod(lambda cls, v: auto_or(v, float)))

    def _check_more(self) -> None:
        if self.max_length < 8:
            raise ConfigError("--max-length must be at least 8")
        if self.epochs <= 0 or (self.lr is not None and self.lr <= 0):
            raise ConfigError("--epochs and --lr must be positive")
        if not self.cpus_per_worker > 0 or (self.gpus_per_worker or 0) < 0:
            raise ConfigError("--cpus-per-worker must be > 0 and --gpus-per-worker >= 0")
        scheme = urlsplit(self.output).scheme
        if len(scheme) > 1 and scheme != "file":  # one letter: a Windows drive
            raise ConfigError(f"--output {self.output}: the model is saved to a local folder")


EPILOG = """\
example:
  mist train --sft outputs/gen-mist --model smollm2-135m-instruct --output outputs/model
  mist train --sft outputs/gen-mist --lora --workers 2 --output outputs/model-lora
"""


def parse_args(argv: list[str] | None, prog: str) -> TrainConfig:
    return parse(TrainConfig, argv, prog, __doc__.split("\n\n")[0], EPILOG)


def main(argv: list[str] | None = None, prog: str = "mist train") -> int:
    """`mist train`: fine-tune a model on a compression output's sft/ records.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help.

    Returns:
        The exit status: 0, or 2 for bad settings, input or a model that cannot load, 4 for
        storage that stayed unavailable (pipelines.common.exits)."""
    return loop.run_main(run, sys.argv[1:] if argv is None else list(argv), parse_args, prog)


if __name__ == "__main__":
    sys.exit(main())
