"""Reading the residual stream: hooks that record h^(0..L) and run batched passes.

h^(0) is the input of the first block (the embeddings, after any model-specific scaling)
and h^(l) the output of block l. When gradients are wanted, h^(0) is re-made a leaf that
requires grad, so every later h^(l) carries a graph while the parameters need none."""
from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..models import LM


def _hidden(output):
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass
class Trace:
    states: list = field(default_factory=list)  # h^(0..L), each [B, S, d]
    block_inputs: list = field(default_factory=list)  # (args, kwargs) of each block, hidden state removed


@contextmanager
def trace(lm: LM, grad: bool = False, capture_inputs: bool = False, on_state=None, keep=None):
    """Record h^(0..L) of the passes run inside the block. `on_state(l, h)` sees each state
    as it appears; `keep(l)` False records None in its place (its memory is not held)."""
    tr = Trace()
    handles = []

    def record(h):
        l = len(tr.states)
        if on_state:
            on_state(l, h.detach())
        tr.states.append(h if keep is None or keep(l) else None)

    def first_pre(module, args, kwargs):
        if args:
            h, rest = args[0], args[1:]
        else:
            h, rest = kwargs.pop("hidden_states"), ()
        if grad:
            h = h.detach().requires_grad_(True)
        record(h)
        return (h, *rest), kwargs

    def capture_pre(module, args, kwargs):
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        tr.block_inputs.append((tuple(args[1:]), kw))

    def post(module, args, kwargs, output):
        record(_hidden(output))

    try:
        handles.append(lm.blocks[0].register_forward_pre_hook(first_pre, with_kwargs=True))
        for block in lm.blocks:
            if capture_inputs:
                handles.append(block.register_forward_pre_hook(capture_pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
        with torch.set_grad_enabled(grad):
            yield tr
    finally:
        for h in handles:
            h.remove()


def transformers_classes(names: dict[str, str]) -> tuple[type, ...]:
    """The classes named by model type in `names` ({"llama": "LlamaMLP"}: from
    transformers.models.llama.modeling_llama) that this transformers has; a model type it
    lacks is left out."""
    import importlib

    found = []
    for arch, name in names.items():
        try:
            module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        except ImportError:
            continue
        if isinstance(getattr(module, name, None), type):
            found.append(getattr(module, name))
    return tuple(found)


@contextmanager
def wrapped_forwards(modules, wrap):
    """Within the block, each module's forward is wrap(module, its forward); afterwards the
    forward it had again (one set on the instance, by hooks, or else its class's)."""
    own = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        m.forward = wrap(m, m.forward)
    try:
        yield
    finally:
        for m, forward in zip(modules, own):
            if forward is None:
                del m.forward
            else:
                m.forward = forward


def wide(t: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors go up to fp32 for reductions; fp32 and fp64 stay as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def pad(seqs: list[np.ndarray], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding: under causal attention real positions never see the pads, so an
    example's numbers do not depend on its batch."""
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def run_base(lm: LM, ids: torch.Tensor, mask: torch.Tensor | None = None, **kwargs):
    """The decoder without its LM head: `.last_hidden_state` is the final-norm output
    [B, S, d]; logits are left to the caller, who computes them only where needed.
    No mask means pure causal attention: right padding needs none, since real positions
    never see the pads after them, and SDPA then takes its causal kernels, which skip the
    masked half and materialise no [S, S] mask."""
    kwargs.setdefault("use_cache", False)
    if mask is not None:
        kwargs["attention_mask"] = mask
    return lm.base(input_ids=ids, **kwargs)


def cache_kwarg(lm: LM) -> str:
    # transformers 5 renamed `past_key_values` to `cache`
    params = inspect.signature(lm.base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class Prefix:
    """Key/value states of a batch of right-padded prefixes, computed once without
    gradients and shared by the passes that continue them."""

    keys: list | None  # per layer [B, kv_heads, width, head_dim]
    values: list | None
    lengths: list[int]
    mask: torch.Tensor

    @classmethod
    def run(cls, lm: LM, prefixes: list[np.ndarray]) -> "Prefix":
        """Prefixes are run in groups of similar length (padding wastes little), then their
        keys and values are laid side by side, right-padded, for the whole batch."""
        lengths = [len(p) for p in prefixes]
        width = max(lengths)
        mask = torch.zeros(len(prefixes), width, dtype=torch.int64, device=lm.device)
        keys = values = None
        for group in similar_lengths(lengths):
            n = max(lengths[i] for i in group)
            if n == 0:
                continue
            ids, gmask = pad([prefixes[i] for i in group], lm.pad_id, lm.device)
            with torch.no_grad():
                out = run_base(lm, ids, attention_mask=gmask, use_cache=True)
            layers = (getattr(out, "cache", None) or out.past_key_values).layers
            if keys is None:
                keys = [layer.keys.new_zeros((len(prefixes), layer.keys.shape[1], width,
                                              layer.keys.shape[3])) for layer in layers]
                values = [torch.zeros_like(k) for k in keys]
            rows = torch.tensor(group, device=lm.device)
            mask[rows, :n] = gmask
            for l, layer in enumerate(layers):
                keys[l][rows, :, :n] = layer.keys
                values[l][rows, :, :n] = layer.values
        return cls(keys, values, lengths, mask)

    def continuation(self, lm: LM, seqs: list[np.ndarray]) -> tuple[torch.Tensor, dict]:
        """Padded ids of the continuations and the base model's arguments that continue this
        prefix: positions, the joint padding mask and a fresh cache (a pass appends to the
        cache it is given, so each pass gets its own)."""
        ids, mask = pad(seqs, lm.pad_id, lm.device)
        start = torch.tensor(self.lengths, device=lm.device)[:, None]
        kwargs = {"position_ids": start + torch.arange(ids.shape[1], device=lm.device)[None],
                  "attention_mask": torch.cat([self.mask, mask], 1)}
        if self.keys is not None:
            from transformers import DynamicCache

            kwargs[cache_kwarg(lm)] = DynamicCache(list(zip(self.keys, self.values)),
                                                   config=lm.model.config)
            kwargs["use_cache"] = True
        return ids, kwargs


def span_logprobs(lm: LM, hidden: torch.Tensor, spans: list[tuple[int, int]],
                  ids: torch.Tensor) -> list[torch.Tensor]:
    """For row b and span (start, stop): log p(ids[b, t] | ids[b, :t]) for t in the span,
    from the logits at positions start-1 .. stop-2 only."""
    rows, pos = [], []
    for b, (start, stop) in enumerate(spans):
        rows.extend([b] * (stop - start))
        pos.extend(range(start, stop))
    lp = token_logprobs(lm, hidden, rows, pos, ids)
    return list(torch.split(lp, [stop - start for start, stop in spans]))


def token_logprobs(lm: LM, hidden: torch.Tensor, rows: Sequence[int], pos: Sequence[int],
                   ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[r, t] | ids[r, :t]) for each pair (r, t) of zip(rows, pos) (t ≥ 1), flat:
    from the logits at position t - 1 only."""
    rows_t = torch.tensor(list(rows), device=hidden.device, dtype=torch.long)
    pos_t = torch.tensor(list(pos), device=hidden.device, dtype=torch.long) - 1
    logits = wide(lm.lm_head(hidden[rows_t, pos_t]))
    return torch.log_softmax(logits, dim=-1).gather(1, ids[rows_t, pos_t + 1][:, None])[:, 0]


def similar_lengths(lengths: list[int], waste: float = 0.05) -> list[list[int]]:
    """Indices grouped by sorted length so that padding stays within `waste` of each
    group's positions."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur, total = [], [], 0
    for i in order:
        if cur and lengths[i] * (len(cur) + 1) - (total + lengths[i]) > waste * lengths[i] * (len(cur) + 1):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += lengths[i]
    return groups + [cur]


# What a batch costs beyond its padded positions, in positions: each batch's passes, hooks
# and small operations. On a CPU measured, by scoring n copies of one GSM8K chain with
# SmolLM2-135M-Instruct (docs/results/performance.md, "Batches cut where padding costs more
# than a batch"). On a GPU an estimate, not yet measured: tens of milliseconds of kernel
# launches and Python a batch against tens of microseconds a position for a 1.5B model.
BATCH_OVERHEAD = {"cpu": 96, "cuda": 1024}


def batch_overhead(device: torch.device) -> int:
    """BATCH_OVERHEAD for `device`; another accelerator's as a GPU's."""
    return BATCH_OVERHEAD.get(device.type, BATCH_OVERHEAD["cuda"])


def length_batches(lengths: list[int], max_tokens: int, max_batch: int,
                   overhead: int = BATCH_OVERHEAD["cpu"]) -> list[list[int]]:
    """Indices in batches of similar length: sorted by length and cut where the padded
    positions, plus `overhead` positions a batch, add up least, each batch within max_batch
    examples and max_tokens padded positions (a longer example than that goes alone): far
    less padding than filling each batch in turn (GSM8K, measured in
    docs/results/performance.md)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [lengths[i] for i in order]
    cost = [0.0] + [math.inf] * len(sizes)  # cost[j]: the j shortest, batched at best
    start = [0] * (len(sizes) + 1)  # where the last batch of that best starts
    for j in range(1, len(sizes) + 1):
        width = sizes[j - 1]  # a batch ending at j is as wide as its last
        for i in range(j - 1, max(j - max_batch, 0) - 1, -1):
            if j - i > 1 and (j - i) * width > max_tokens:
                break
            c = cost[i] + (j - i) * width + overhead
            if c < cost[j]:
                cost[j], start[j] = c, i
    batches, j = [], len(sizes)
    while j:
        batches.append(order[start[j]:j])
        j = start[j]
    return batches[::-1]
