"""Supervised fine-tuning on the compression job's SFT records (`mist train`): TRL's
SFTTrainer with the loss on the completion only (the chain and the answer line), full
fine-tuning or LoRA (merged into the weights before saving), and the result saved as a
model folder that `load_model` and `mist generate`/`mist solve` read.

Records are the job's `prompt-completion`, `messages` or `alpaca` records. They are all
turned into TRL's prompt-completion layout: with a chat template, the conversational one
(the user turn rendered with the generation prompt, exactly what generation.prompt_text
gives at decoding time); without one, plain text built by generation.plain_prompt, which
decoding uses identically. No Ray here: pipelines/loop/train.py runs this in-process or under
Ray Train, one copy per worker."""
from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from ..errors import MissingDependency
from ..models import LM
from .generation import encode_prompt, has_chat_template, render_prompt

log = logging.getLogger(__name__)
REPORT = "training.json"  # written beside the weights: settings and the loss curve


# ---------------------------------------------------------------- records

def record_turns(rec) -> tuple[str, str]:
    """The user turn and the assistant turn of one SFT record, whatever its layout; a
    ValueError that says what is wrong for anything else (so that `mist train` can check
    every record before it loads a model)."""
    if not isinstance(rec, dict):
        raise ValueError(f"an SFT record is a JSON object, not a {type(rec).__name__}")
    try:
        user, assistant = _user_and_assistant(rec)
    except (TypeError, AttributeError, KeyError):  # a turn list of the wrong shape
        raise ValueError("an SFT record's turns must be {role, content} objects") from None
    if not isinstance(user, str) or not isinstance(assistant, str):
        raise ValueError("an SFT record's user and assistant turns must be text")
    return user, assistant


def _user_and_assistant(rec: dict) -> tuple[str, str]:
    if "prompt" in rec and "completion" in rec:
        prompt, completion = rec["prompt"], rec["completion"]
        user = prompt if isinstance(prompt, str) else _last(prompt, "user")
        assistant = completion if isinstance(completion, str) else _last(completion, "assistant")
        return user, assistant
    if "messages" in rec:
        return _last(rec["messages"], "user"), _last(rec["messages"], "assistant")
    if "instruction" in rec and "output" in rec:
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        return user, rec["output"]
    raise ValueError("an SFT record needs prompt/completion, messages or instruction/output; "
                     f"this one has {sorted(map(str, rec))[:8]}")


def _last(turns: list, role: str) -> str:
    found = [t["content"] for t in turns if t.get("role") == role]
    if not found:
        raise ValueError(f"an SFT record has no {role} turn")
    return found[-1]


def training_record(rec: dict, tokenizer) -> dict:
    """A record as TRL's prompt-completion example for this tokenizer: conversational
    where the tokenizer has a chat template (TRL renders the prompt with the generation
    prompt and puts the loss on the assistant turn), else plain text (TRL appends the
    end-of-sequence token to the completion)."""
    user, assistant = record_turns(rec)
    if has_chat_template(tokenizer):
        return {"prompt": [{"role": "user", "content": user}],
                "completion": [{"role": "assistant", "content": assistant}]}
    return {"prompt": render_prompt(tokenizer, user), "completion": assistant}


def read_sft(path: str | os.PathLike, filesystem=None) -> list[dict]:
    """The SFT records of a compression job's output: its folder (reads `sft/`), the
    `sft/` folder itself, or one file; JSONL or parquet. `filesystem`: a pyarrow filesystem
    that `path` is on (pipelines.common.storage makes one for s3:// and gs://); local without."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs = filesystem or pafs.LocalFileSystem()
    root = str(path) if filesystem is not None else os.path.abspath(os.path.expanduser(str(path)))
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"no SFT records at {path}")
    if info.type == pafs.FileType.Directory:
        sub = posixpath.join(root, "sft")
        if fs.get_file_info(sub).type == pafs.FileType.Directory:
            root = sub
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        # Hidden names (`_tmp-…` of a run still writing, `.…`) are not records.
        files = sorted(i.path for i in infos if i.type == pafs.FileType.File and not any(
            part.startswith((".", "_")) for part in posixpath.relpath(i.path, root).split("/")))
    else:
        files = [root]
    records = []
    for f in files:
        if f.endswith((".parquet", ".pq")):
            records += pq.read_table(f, filesystem=fs).to_pylist()
        elif f.endswith((".jsonl", ".json", ".ndjson")):
            with fs.open_input_stream(f) as stream:
                records += [json.loads(line) for line in stream.read().decode("utf-8").splitlines()
                            if line.strip()]
    if not records:
        raise FileNotFoundError(f"no SFT records (.jsonl or .parquet) under {path}")
    return records


# ---------------------------------------------------------------- loss

@torch.no_grad()
def completion_loss(model, tokenizer, records: Iterable[dict], max_length: int = 2048) -> float:
    """Mean cross-entropy per completion token over the records, tokenized as TRL tokenizes
    them for training (the prompt carries no loss): how well a model has learnt them."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    try:
        for rec in records:
            ex = training_record(rec, tokenizer)
            if isinstance(ex["prompt"], list):
                prompt = encode_prompt(tokenizer, render_prompt(tokenizer, ex["prompt"][0]["content"]))
                full = tokenizer.apply_chat_template(ex["prompt"] + ex["completion"], tokenize=False)
                ids = encode_prompt(tokenizer, full)
            else:
                prompt = encode_prompt(tokenizer, ex["prompt"])
                ids = encode_prompt(tokenizer, ex["prompt"] + ex["completion"] + tokenizer.eos_token)
            start = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b),
                         min(len(prompt), len(ids)))
            ids = ids[:max_length]
            if start >= len(ids):
                continue
            x = torch.tensor([ids], device=device)
            logits = model(x).logits[0, :-1].float()
            target = x[0, 1:]
            losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")
            total += float(losses[start - 1:].sum())
            count += len(ids) - start
    finally:
        model.train(was_training)
    return total / count if count else float("nan")


# ---------------------------------------------------------------- training

def _load(model: str | LM, trust_remote_code: bool = False):
    """(model, tokenizer, the LM handle to restore afterwards or None)."""
    if isinstance(model, LM):
        model.model.requires_grad_(True)  # load_model/wrap_model freeze it for scoring
        model.model.train()
        return model.model, model.tokenizer, model
    from ..models import load_model

    lm = load_model(model, for_training=True, trust_remote_code=trust_remote_code)
    return lm.model, lm.tokenizer, None


def finetune(model: str | LM, records: Iterable[dict], output_dir: str | os.PathLike, *,
             lora: bool = False, lora_rank: int = 16, epochs: float = 1.0,
             learning_rate: float = 2e-5, batch_size: int = 8, max_length: int = 2048,
             seed: int = 0, log_every: int = 10, trust_remote_code: bool = False,
             gradient_checkpointing: bool = True) -> Path:
    """Fine-tune `model` (a spec load_model reads, or an LM in memory, trained in place) on
    SFT records and save it to `output_dir` (safetensors weights, tokenizer, and
    training.json with the settings and the loss curve). LoRA adapters (rank `lora_rank` on
    every linear layer of the blocks) are merged into the weights before saving, so the
    folder is a plain model either way. Under torch.distributed (Ray Train) every process
    trains its shard and only the first saves. A model folder's own Python code runs only
    with trust_remote_code. gradient_checkpointing (TRL's default) recomputes the blocks'
    activations in the backward pass: less memory for a large model, more time (the
    testbed's tiny models turn it off). Returns the folder."""
    from datasets import Dataset

    try:
        from trl import SFTConfig, SFTTrainer
        if lora:
            from peft import LoraConfig
    except ImportError as e:
        raise MissingDependency(f"fine-tuning needs TRL{' and peft' if lora else ''} ({e.name} "
                                "is missing): pip install 'mist-cot[train]'") from None
    net, tokenizer, handle = _load(model, trust_remote_code)
    rows = [training_record(r, tokenizer) for r in records]
    if not rows:
        raise ValueError("no SFT records to train on")
    n_positions = getattr(net.config, "max_position_embeddings", None) or max_length
    # A model in memory trains where it is; one loaded here goes where the Trainer puts it
    # (the GPU where there is one).
    cuda = (next(net.parameters()).device.type == "cuda" if handle is not None
            else torch.cuda.is_available())
    peft_config = None
    if lora:
        peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    out = Path(output_dir)
    scratch = tempfile.mkdtemp(prefix="mist-train-")  # the trainer's own folder: nothing kept
    try:
        args = SFTConfig(
            output_dir=scratch, num_train_epochs=epochs, learning_rate=learning_rate,
            per_device_train_batch_size=batch_size, max_length=min(max_length, int(n_positions)),
            completion_only_loss=True, packing=False, seed=seed, data_seed=seed,
            logging_steps=log_every, logging_first_step=True, save_strategy="no",
            report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            use_cpu=not cuda, bf16=cuda and torch.cuda.is_bf16_supported(),
            gradient_checkpointing=gradient_checkpointing)
        trainer = SFTTrainer(model=net, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, peft_config=peft_config)
        result = trainer.train()
        if trainer.is_world_process_zero():
            trained = trainer.model
            if lora:  # one plain model folder: the adapters folded into the weights (and,
                # for a model in memory, its own modules back in place, updated)
                trained = trained.merge_and_unload()
            out.mkdir(parents=True, exist_ok=True)
            trained.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
            losses = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history
                      if "loss" in h]
            (out / REPORT).write_text(json.dumps({
                "records": len(rows), "steps": result.global_step,
                "train_loss": result.training_loss, "losses": losses,
                "world_size": trainer.args.world_size,
                "settings": {"lora": lora, "lora_rank": lora_rank if lora else None,
                             "epochs": epochs, "learning_rate": learning_rate,
                             "batch_size_per_device": batch_size, "max_length": args.max_length,
                             "seed": seed, "gradient_checkpointing": args.gradient_checkpointing}},
                indent=2) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if handle is not None:  # back to a scoring/decoding handle: frozen, eval mode
            handle.model.requires_grad_(False)
            handle.model.eval()
    return out
