"""GPU memory a scoring actor needs, by model shape and chain length, from the scorer's own
memory model (mist_core.scoring.memory): the weights plus what one chain's passes take under the
recomputed regime (the least the scorer can run a chain in). Per-layer costs are measured on
a two-layer copy of each shape in bf16 on CPU (the footprint per layer does not depend on
depth, and the probe needs no GPU), then scaled to the full depth.

    python benchmarks/sizing.py            # the table behind the README's instance sizing
"""
from __future__ import annotations

import dataclasses

import torch

from mist_core.scoring import memory
from mist_core.scoring.passes import Plan
from pipelines.bench.shapes import SHAPES, random_model

SMOLLM2 = dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
LENGTHS = (2048, 4096, 8192, 16384, 32768)


def footprint(shape: dict, dtype: str = "bfloat16") -> tuple[memory.Footprint, float]:
    """(the footprint at full depth, the weights' bytes)."""
    L = shape["num_hidden_layers"]
    SHAPES["_probe"] = {**shape, "num_hidden_layers": 2, "vocab_size": 1024}
    lm = random_model("_probe", dtype, "cpu")
    fp = memory.measure(lm)
    elt = torch.finfo(getattr(torch, dtype)).bits // 8
    d, v, inter = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = d // heads
    per_layer = 2 * d + d * hd * (heads + 2 * kv) + heads * hd * d + 3 * d * inter
    weights = elt * (L * per_layer + 2 * v * d)
    full = dataclasses.replace(fp, stored=fp.block * L, layers=L, kv=fp.kv / 2 * L)
    return full, weights


def main() -> None:
    gib = 2**30
    models = {"SmolLM2-135M": SMOLLM2, "Qwen2.5-1.5B": SHAPES["qwen2.5-1.5b"],
              "Qwen2.5-7B": SHAPES["qwen2.5-7b"]}
    print("| model (bf16) | weights | " + " | ".join(f"{n // 1024}k tokens" for n in LENGTHS) + " |")
    print("|---|---|" + "---|" * len(LENGTHS))
    for name, shape in models.items():
        fp, weights = footprint(dict(shape))
        cells = [f"{(weights + fp.need(n, Plan(recompute=True), logit_rows=8, vocab=shape['vocab_size'])) / gib:.1f}"
                 for n in LENGTHS]
        print(f"| {name} | {weights / gib:.1f} GiB | " + " | ".join(cells) + " |")
    print("\nGiB per scoring actor: weights + one chain's passes (recomputed, with the "
          f"allocator allowance {memory.Footprint.OVERHEAD}).")


if __name__ == "__main__":
    main()
