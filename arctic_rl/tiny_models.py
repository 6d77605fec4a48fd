"""Tiny causal LMs and a character-level tokenizer, built locally (no model hub).

Tests, examples and benchmarks need real ``transformers`` models that load with
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)`` -- the
same code path as a real checkpoint -- but cannot download one. This module writes such a
directory: a 99-symbol character tokenizer with a ChatML-style chat template (``<|im_start|>``,
``<|im_end|>``; left padding) and a randomly initialised model of one of several architectures
(Qwen3, Qwen2, Llama) from a config.

It is not a model zoo: sizes are for CPU tests (well under a million parameters by default).
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Literal

__all__ = ["ARCHITECTURES", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_char_tokenizer", "build_tiny_model", "tiny_config"]

#: ``<|endoftext|>`` is padding and unknown; ``<|im_end|>`` ends a turn (the EOS for generation).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHITECTURES = ("qwen3", "qwen2", "llama")
Architecture = Literal["qwen3", "qwen2", "llama"]


def build_char_tokenizer(out_dir: str | os.PathLike | None = None):
    """A fast tokenizer with one token per printable ASCII character (plus space and newline).

    Saved to ``out_dir`` when given. Returns a ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + symbols)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # every character alone
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=1024,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def tiny_config(
    arch: Architecture = "qwen3",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    tie_word_embeddings: bool = True,
):
    """A ``transformers`` config of the given architecture and size."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: expected one of {list(ARCHITECTURES)}, got {arch!r}")
    head_dim = head_dim or hidden_size // num_heads
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
    }
    if arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if arch == "qwen2":
        if head_dim * num_heads != hidden_size:
            raise ValueError("qwen2 derives head_dim from hidden_size/num_heads; do not pass another head_dim")
        return Qwen2Config(**common)
    return LlamaConfig(head_dim=head_dim, **common)


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: Architecture = "qwen3",
    *,
    seed: int = 0,
    tokenizer=None,
    **config_kwargs,
) -> Path:
    """Write a randomly initialised tiny model plus the char tokenizer to ``out_dir``.

    ``config_kwargs`` go to :func:`tiny_config` (``hidden_size``, ``num_layers``, ...).
    Deterministic for a given ``seed``. Returns the directory.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    config = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_kwargs,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


if __name__ == "__main__":  # python -m arctic_rl.tiny_models OUT_DIR [ARCH]
    import sys

    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m arctic_rl.tiny_models OUT_DIR [qwen3|qwen2|llama]")
    path = build_tiny_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen3")
    print(f"wrote a tiny {sys.argv[2] if len(sys.argv) > 2 else 'qwen3'} model to {path}")
