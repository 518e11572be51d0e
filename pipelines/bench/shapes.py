"""Public models' shapes with random weights, for speed and memory measurements that need
no download (`mist bench --model random:<shape>`, the long-chain sweep, benchmarks/sizing.py)."""
from __future__ import annotations

import torch

from mist_core import wrap_model

# Shapes of public models, for speed measurements with random weights.
SHAPES = {
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}

def random_model(shape: str, dtype: str, device: str, context: int = 4096):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("arch"), max_position_embeddings=context,
                                  tie_word_embeddings=False, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa")
    return wrap_model(model, None, f"random:{shape}")
