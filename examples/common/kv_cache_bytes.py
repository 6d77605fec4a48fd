"""The KV-cache size, in bytes, that holds one step's whole batch at full length for a model directory.

vLLM splits a fixed ``kv_cache_memory_bytes`` into blocks of ``block_size`` token slots; one block of one layer
holds keys and values for ``block_size`` tokens: ``2 x num_key_value_heads x head_dim x dtype bytes`` each. A
step's batch needs ``ceil(max_model_len / block_size)`` blocks per sequence for ``seqs`` sequences at once, plus
one block per sequence of slack (vLLM keeps a reserved null block, and a sequence may straddle one more block).
Sizing the cache to that, rather than to a share of the GPU, keeps an always-awake sampler (asynchronous GRPO,
docs/ASYNC.md) from holding memory the batch never uses; a smaller cache still works, with fewer sequences in
flight.

``--samples N`` sizes the same batch as ``seqs / N`` prompts of N samples each, with each prompt's blocks held
once: vLLM's prefix cache shares a prompt's full blocks between the requests that carry it (GRPO's N samples of
one prompt; on by default in vLLM and in verl's rollout config), so a sample holds only its response and the
prompt's last, partly filled block. At the arithmetic recipe's 64 x 8 (256 + 128 tokens) that is 5,633 blocks
instead of 12,800; with 1,600-token few-shot prompts at 16 x 8, 2,753 instead of 13,952.

    python examples/common/kv_cache_bytes.py MODEL_DIR --seqs 128 --max-model-len 384          # prints the bytes
    python examples/common/kv_cache_bytes.py MODEL_DIR --seqs 128 --max-model-len 384 --samples 8 --response-len 128
    KV_CACHE_BYTES=batch bash examples/grpo/run_arithmetic_grpo_smollm2.sh                    # the recipes' use
    KV_CACHE_BYTES=shared bash examples/grpo/run_arithmetic_grpo_smollm2.sh                   # prompts held once

Only the model's ``config.json`` is read (Llama/Qwen-style keys: ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``hidden_size``, ``head_dim``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_elements_per_token(config: dict) -> int:
    """Key and value elements one token occupies across every layer (multiply by the dtype's size for bytes)."""
    def positive(name: str, value: object) -> int:
        if int(value) <= 0:
            raise ValueError(f"config.json: {name} must be positive, got {value}")
        return int(value)

    try:
        layers = positive("num_hidden_layers", config["num_hidden_layers"])
        heads = positive("num_attention_heads", config["num_attention_heads"])
        kv_heads = positive("num_key_value_heads", config.get("num_key_value_heads") or heads)
        head_dim = positive("head_dim", config.get("head_dim") or int(config["hidden_size"]) // heads)
    except KeyError as missing:
        raise ValueError(f"config.json: expected the key {missing.args[0]!r} (a decoder's attention shape)") from None
    return layers * 2 * kv_heads * head_dim


def _check(dtype: str, **positive: int) -> None:
    """A known dtype, and every keyword a positive integer; the first that is not names itself."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    for name, value in positive.items():
        if value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value}")


def _bytes(config: dict, blocks: int, *, dtype: str, block_size: int) -> int:
    """``blocks`` whole blocks of ``block_size`` tokens, in bytes, for the model's attention shape."""
    return blocks * block_size * kv_elements_per_token(config) * DTYPE_BYTES[dtype]


def batch_kv_cache_bytes(config: dict, *, seqs: int, max_model_len: int, dtype: str = "bfloat16",
                         block_size: int = 16) -> int:
    """The cache that holds ``seqs`` sequences of ``max_model_len`` tokens at once, in whole blocks."""
    _check(dtype, seqs=seqs, max_model_len=max_model_len, block_size=block_size)
    blocks = seqs * (math.ceil(max_model_len / block_size) + 1)
    return _bytes(config, blocks, dtype=dtype, block_size=block_size)


def shared_prompt_kv_cache_bytes(config: dict, *, seqs: int, samples: int, max_model_len: int, response_len: int,
                                 dtype: str = "bfloat16", block_size: int = 16) -> int:
    """The cache that holds ``seqs`` sequences as ``seqs / samples`` prompts of ``samples`` each, a prompt's
    blocks held once (vLLM's prefix cache): per prompt ``ceil(prompt / block_size)`` blocks, per sample its
    response's ``ceil(response_len / block_size)`` plus one (the prompt's last block, partly filled, is the
    sample's own), plus vLLM's one reserved null block."""
    _check(dtype, seqs=seqs, samples=samples, max_model_len=max_model_len, response_len=response_len,
           block_size=block_size)
    if seqs % samples:
        raise ValueError(f"samples: expected a divisor of seqs ({seqs}), got {samples}")
    if response_len >= max_model_len:
        raise ValueError(f"response_len: expected fewer tokens than max_model_len ({max_model_len}), "
                         f"got {response_len}")
    prompts = seqs // samples
    prompt_len = max_model_len - response_len
    blocks = prompts * math.ceil(prompt_len / block_size) + seqs * (math.ceil(response_len / block_size) + 1) + 1
    return _bytes(config, blocks, dtype=dtype, block_size=block_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model_dir", type=Path, help="a model directory holding config.json")
    parser.add_argument("--seqs", type=int, required=True, help="sequences of one step (prompts x samples)")
    parser.add_argument("--max-model-len", type=int, required=True, help="prompt + response tokens")
    parser.add_argument("--dtype", default="bfloat16", help="the KV cache's dtype (the model's on a GPU)")
    parser.add_argument("--block-size", type=int, default=16, help="vLLM's block size")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per prompt: hold each prompt's blocks once (needs --response-len)")
    parser.add_argument("--response-len", type=int, default=None, help="response tokens (of --max-model-len)")
    args = parser.parse_args(argv)
    knob = "KV_CACHE_BYTES=batch" if args.samples is None else "KV_CACHE_BYTES=shared"
    if (args.samples is None) != (args.response_len is None):
        parser.error("--samples and --response-len go together")
    config_path = args.model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
        sizing = {"seqs": args.seqs, "max_model_len": args.max_model_len, "dtype": args.dtype,
                  "block_size": args.block_size}
        if args.samples is None:
            print(batch_kv_cache_bytes(config, **sizing))
        else:
            print(shared_prompt_kv_cache_bytes(config, samples=args.samples, response_len=args.response_len, **sizing))
    except (OSError, json.JSONDecodeError) as err:
        print(f"{knob}: cannot read the model's {config_path}: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"{knob}: {config_path}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
