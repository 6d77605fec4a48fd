"""Attention shapes of the real models the recipes use, as their ``config.json`` gives them (the keys that size a
KV cache), for tests that need a model's shape without its weights."""

from __future__ import annotations

# SmolLM2-135M-Instruct: 30 layers, 9 query heads over 3 key/value heads, width 576 (head dim 64).
SMOLLM2_ATTENTION: dict[str, int] = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
}
