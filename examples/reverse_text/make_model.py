"""Write the reverse-text example's untrained model: a tiny Qwen3 with the character tokenizer.

Size from the measured recipe (shared/design/REVERSE_TEXT_RECIPE.md): hidden 128, 2 layers,
4 attention heads of dim 32, 2 KV heads, FFN 512, tied embeddings -- about 0.5M parameters. Smaller
(hidden 64) learns too slowly under RL; larger costs more than it gains on 2 CPU cores.

The directory loads with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained`` like any
checkpoint; it is the *initial* weights -- ``warm_start.py`` turns it into the GRPO starting point.

Usage: ``python examples/reverse_text/make_model.py --out DIR [--seed 0]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: The recipe's model size, as ``arctic_rl.tiny_models.build_tiny_model`` keyword arguments.
RECIPE_SIZE: dict[str, int | bool] = {
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "head_dim": 32,
    "num_kv_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def make_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny Qwen3 of :data:`RECIPE_SIZE` with random weights (``seed``) into ``out_dir``."""
    from arctic_rl.tiny_models import build_tiny_model

    return build_tiny_model(out_dir, "qwen3", seed=seed, **RECIPE_SIZE)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = make_model(a.out, a.seed)
    from transformers import AutoModelForCausalLM

    n = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"[make_model] wrote a tiny qwen3 (~{n / 1e6:.2f}M parameters, seed {a.seed}) to {out}")


if __name__ == "__main__":
    main()
