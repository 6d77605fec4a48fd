"""Random-weight Qwen3-shaped models for ``benchmarks/max_model.py``: the real shapes, bf16, a local tokenizer.

Sizes (:data:`SIZES`) carry the shapes of Qwen's published ``config.json`` files (Qwen3-0.6B, -1.7B, -4B,
-8B, -14B: hidden size, layers, query / key-value heads of 128, MLP size, vocabulary 151,936, tied
embeddings up to 4B, RoPE theta 1e6, RMSNorm eps 1e-6) plus ``tiny`` (2 layers, hidden 64; its vocabulary the
tokenizer's, rounded up to a multiple of 128 plus 128) for the CPU tests. :func:`param_count` computes a size's parameters from its shape, nothing allocated.

:func:`build_model` writes a directory that vLLM, verl and the reference server load like any Hugging Face
checkpoint: ``config.json`` (``Qwen3ForCausalLM``), bf16 safetensors (shards of at most 5 GB), a tokenizer
and ``qwen3_random.json`` (what was built, when, from what). There is no model hub on the GPU machine, so
the tokenizer is copied from a local directory -- SmolLM2-135M-Instruct's, the one the arithmetic recipe
builds (``examples/arithmetic/make_model.py``), with its chat template -- and its vocabulary is padded up
to the model's with filler tokens ``<fill_N>`` that no text encodes to. Why pad: a random model samples
every id of its 151,936 about equally, so two thirds of its tokens would lie past SmolLM2's 49,152, ids
vLLM's detokenizer and verl's decoding would have to survive; padded, every id decodes. The special
tokens (bos, eos, pad) keep their ids, far inside the vocabulary.

Weights: ``normal(0, 0.02)`` for every matrix and the embedding, ones for the norms (Hugging Face's own
init), built on the GPU when there is one (seconds for 8B; the CPU takes minutes at that size), then
saved; 8B is ~16 GB on disk, 14B ~30 GB. The directory is written beside ``--out`` and renamed into place.

    python benchmarks/qwen3_random.py --size 8b --out /tmp/qwen3_8b --tokenizer-from /tmp/arith/smollm2_135m_instruct
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

#: Qwen3 shapes: hidden, layers, query heads, key-value heads, MLP size, tied embeddings (head_dim 128 each)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": None, "tie_word_embeddings": True},
    "0.6b": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "intermediate_size": 3072, "tie_word_embeddings": True},
    "1.7b": {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "intermediate_size": 6144, "tie_word_embeddings": True},
    "4b": {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 9728, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 12288, "tie_word_embeddings": False},
    "14b": {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
            "intermediate_size": 17408, "tie_word_embeddings": False},
}
#: every real size shares these
COMMON = {"head_dim": 128, "vocab_size": 151936, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False}
#: the billions of parameters the size's name says
NOMINAL_B = {"0.6b": 0.6, "1.7b": 1.7, "4b": 4.0, "8b": 8.0, "14b": 14.0}
MARKER = "qwen3_random.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def shape(size: str, vocab_size: int | None = None) -> dict[str, Any]:
    """The ``Qwen3Config`` keyword arguments of ``size`` (without token ids); ``vocab_size`` for ``tiny``."""
    if size not in SIZES:
        raise SystemExit(f"[qwen3_random] size: expected one of {', '.join(SIZES)}, got {size!r}")
    s = {**COMMON, **SIZES[size]}
    if s["vocab_size"] is None:
        s["vocab_size"] = vocab_size or 1024
    return s


def tiny_vocab(tokenizer_ids: int) -> int:
    """The ``tiny`` size's vocabulary for a tokenizer of ``tokenizer_ids`` ids: padding always happens."""
    return (tokenizer_ids + 127) // 128 * 128 + 128


def param_count(size: str, vocab_size: int | None = None) -> int:
    """Parameters of ``size`` from its shape (tied embeddings counted once), nothing allocated."""
    s = shape(size, vocab_size)
    h, hd, inter = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * hd  # q, k, v, o, MLP, 2 norms, q/k norms
    embed = s["vocab_size"] * h
    return s["num_hidden_layers"] * layer + embed * (1 if s["tie_word_embeddings"] else 2) + h


def tokenizer_ids(path: Path) -> int:
    """How many ids ``tokenizer.json`` uses (its largest id + 1, added tokens included)."""
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        raise SystemExit(f"[qwen3_random] {path}: model type {data.get('model', {}).get('type')!r} has no "
                         "token -> id vocabulary to pad (BPE, WordLevel and WordPiece have one)")
    return max(set(vocab.values()) | {int(t["id"]) for t in data.get("added_tokens") or []}) + 1


def pad_tokenizer_json(path: Path, vocab_size: int) -> tuple[int, int]:
    """Pad ``tokenizer.json``'s model vocabulary with ``<fill_N>`` tokens up to ``vocab_size`` ids; return
    ``(ids before, ids after)``. A model type without a token -> id table (Unigram) is refused."""
    before = tokenizer_ids(path)
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    if before > vocab_size:
        raise SystemExit(f"[qwen3_random] the tokenizer has {before} ids, more than the model's vocabulary "
                         f"({vocab_size})")
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens") or []}
    for i in range(before, vocab_size):
        token = f"<fill_{i}>"
        if token in taken:
            raise SystemExit(f"[qwen3_random] {path}: {token!r} is already a token")
        vocab[token] = i
    path.write_text(json.dumps(data, ensure_ascii=False))
    return before, vocab_size


def copy_tokenizer(source: Path, out: Path, vocab_size: int) -> dict[str, Any]:
    """The tokenizer of ``source`` in ``out``, padded to ``vocab_size``; its special ids, checked."""
    from transformers import AutoTokenizer

    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    before, after = pad_tokenizer_json(out / "tokenizer.json", vocab_size)
    tok = AutoTokenizer.from_pretrained(str(out))
    if len(tok) != vocab_size:
        raise SystemExit(f"[qwen3_random] padded tokenizer has {len(tok)} tokens, expected {vocab_size}")
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    if ids["eos_token_id"] is None:
        raise SystemExit(f"[qwen3_random] the tokenizer of {source} has no eos token")
    if not tok.chat_template:
        raise SystemExit(f"[qwen3_random] the tokenizer of {source} has no chat template (verl renders prompts with it)")
    return {"tokenizer_from": str(source), "tokenizer_ids": before, "tokenizer_padded_to": after, **ids}


def build_model(size: str, out: str | Path, tokenizer_from: str | Path, *, seed: int = 0,
                device: str = "auto") -> Path:
    """Write the model directory ``out`` (see the module docstring); a finished one (with its marker) is kept."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out).resolve()
    if (out / MARKER).is_file():
        print(f"[qwen3_random] cached: {out}", flush=True)
        return out
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"[qwen3_random] --out: {out} exists without {MARKER}; remove it or pick another --out")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.partial-", dir=out.parent) as tmp:
        build = Path(tmp) / "model"
        build.mkdir()
        source = Path(tokenizer_from).resolve()
        if not (source / "tokenizer.json").is_file():
            raise SystemExit(f"[qwen3_random] --tokenizer-from: {source} has no tokenizer.json")
        s = shape(size, tiny_vocab(tokenizer_ids(source / "tokenizer.json")) if size == "tiny" else None)
        info = copy_tokenizer(source, build, s["vocab_size"])
        config = Qwen3Config(**s, bos_token_id=info["bos_token_id"], eos_token_id=info["eos_token_id"],
                             pad_token_id=info["pad_token_id"])
        config.architectures = ["Qwen3ForCausalLM"]
        default_dtype = torch.get_default_dtype()
        torch.manual_seed(seed)
        try:
            torch.set_default_dtype(torch.bfloat16)
            with torch.device(device):
                model = Qwen3ForCausalLM(config)
                with torch.no_grad():  # Hugging Face's init, stated here: N(0, 0.02) matrices, unit norms
                    for name, p in model.named_parameters():
                        if p.dim() >= 2:
                            p.normal_(0.0, config.initializer_range)
                        else:
                            p.fill_(1.0)
        finally:
            torch.set_default_dtype(default_dtype)
        model.generation_config.eos_token_id = info["eos_token_id"]
        model.generation_config.pad_token_id = info["pad_token_id"]
        params = sum(p.numel() for p in model.parameters())  # tied weights once
        model.save_pretrained(str(build), max_shard_size="5GB")
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        marker = {"size": size, "params": params, "params_from_shape": param_count(size, s["vocab_size"]), "dtype": "bfloat16",
                  "seed": seed, "device": device, **info, "shape": s, "built_s": round(time.monotonic() - start, 1)}
        (build / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if out.is_dir():
            out.rmdir()
        os.replace(build, out)
    print(f"[qwen3_random] wrote {out}: Qwen3 {size}, {params:,} parameters, bf16, built on {device} "
          f"({time.monotonic() - start:.0f} s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", required=True, choices=sorted(SIZES))
    p.add_argument("--out", required=True, help="model directory to write (kept when already finished)")
    p.add_argument("--tokenizer-from", required=True, help="a model directory whose tokenizer (and chat template) to copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda or cpu")
    a = p.parse_args(argv)
    build_model(a.size, a.out, a.tokenizer_from, seed=a.seed, device=a.device)


if __name__ == "__main__":
    main()
