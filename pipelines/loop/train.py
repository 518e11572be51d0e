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

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from . import base as loop
from ..common import runtime, storage
from ..common.errors import ConfigError
from ..common.settings import one_line

TRAINING_OPTIONS = ("lora", "lora_rank", "epochs", "learning_rate", "batch_size", "max_length",
                    "seed", "log_every", "trust_remote_code")


def read_records(uris: list[str]) -> list[dict]:
    """The SFT records of every --sft (an output folder, its sft/, or files; local, s3://,
    gs://), in order, each checked to be one (before any model loads)."""
    from mist_core.finetune import read_sft, record_turns

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

    from mist_core.finetune import REPORT, finetune

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


def train_distributed(args: argparse.Namespace, records: list[dict], options: dict,
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
    from mist_core.finetune import REPORT

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


def run(args: argparse.Namespace) -> int:
    from mist_core.finetune import REPORT, finetune

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


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=EPILOG)
    p.add_argument("--sft", nargs="+", required=True, metavar="PATH",
                   help="compression job output folders (their sft/ is read), sft/ folders or "
                        "files (JSONL or parquet; local, s3://, gs://)")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the model to fine-tune: hub id, local folder, .gguf file or "
                        "smollm2-135m-instruct (default)")
    p.add_argument("--output", required=True,
                   help="local folder for the trained model: new or empty, or with "
                        "--overwrite a model `mist train` saved there earlier")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the model an earlier `mist train` saved in --output (once "
                        "the new one is trained)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (merged when saved)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 2e-5, or 2e-4 with --lora)")
    p.add_argument("--batch-size", type=int, default=8, help="records per step per worker")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per record, cut beyond")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="steps between logged losses")
    p.add_argument("--workers", type=int, default=1,
                   help="1: train in this process; N: N Ray Train workers (default: 1)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--gpus-per-worker", default="auto",
                   type=lambda v: None if v == "auto" else float(v),
                   help="GPUs per Ray Train worker (default: 1 where the cluster has GPUs)")
    p.add_argument("--storage-path", default=None,
                   help="where Ray Train keeps the checkpoint (s3://… or a shared folder on a "
                        "multi-machine cluster; default: a temporary local folder)")
    p.add_argument("--address", default=None,
                   help="Ray cluster for --workers N (default: $RAY_ADDRESS or a new local Ray)")
    loop.add_verbose(p)
    loop.add_trust_remote_code(p)
    return p


EPILOG = """\
example:
  mist train --sft outputs/gen-mist --model smollm2-135m-instruct --output outputs/model
  mist train --sft outputs/gen-mist --lora --workers 2 --output outputs/model-lora
"""


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    args = build_parser(prog).parse_args(argv)
    if args.workers < 1 or args.batch_size < 1 or args.lora_rank < 1 or args.max_length < 8:
        raise ConfigError("--workers, --batch-size and --lora-rank must be at least 1, "
                          "--max-length at least 8")
    if args.epochs <= 0 or (args.lr is not None and args.lr <= 0):
        raise ConfigError("--epochs and --lr must be positive")
    scheme = urlsplit(args.output).scheme
    if len(scheme) > 1 and scheme != "file":  # one letter: a Windows drive
        raise ConfigError(f"--output {args.output}: the model is saved to a local folder")
    return args


def main(argv: list[str] | None = None, prog: str = "mist train") -> int:
    return loop.run_main(run, sys.argv[1:] if argv is None else list(argv), parse_args, prog)


if __name__ == "__main__":
    sys.exit(main())
