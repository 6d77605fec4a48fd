"""``examples/common/kv_cache_bytes.py``: the KV cache that holds one step's batch, from a model's config.json.

The expected sizes are worked out by hand from vLLM's layout (a block of one layer holds keys and values of
16 tokens: 2 x key/value heads x head size x dtype bytes each) for real models' shapes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.model_shapes import SMOLLM2_ATTENTION as SMOLLM2
from tests.support.scripts import REPO_ROOT, load_script

SCRIPT = REPO_ROOT / "examples" / "common" / "kv_cache_bytes.py"
kv = load_script("examples/common/kv_cache_bytes.py")
batch_kv_cache_bytes, kv_elements_per_token = kv.batch_kv_cache_bytes, kv.kv_elements_per_token
shared_prompt_kv_cache_bytes = kv.shared_prompt_kv_cache_bytes
# Qwen3-4B: head_dim is given and is not hidden_size / heads (2560 / 32 = 80)
QWEN3_4B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2560,
            "head_dim": 128}


def test_per_token_elements_follow_the_attention_shape():
    assert kv_elements_per_token(SMOLLM2) == 30 * 2 * 3 * 64
    assert kv_elements_per_token(QWEN3_4B) == 36 * 2 * 8 * 128
    # no num_key_value_heads: every query head has its own (multi-head attention)
    assert kv_elements_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}) == 2 * 2 * 4 * 16


def test_the_batch_in_whole_blocks_with_one_spare_per_sequence():
    # 128 sequences of 384 tokens: 24 blocks each + 1
    assert batch_kv_cache_bytes(SMOLLM2, seqs=128, max_model_len=384) == 128 * 25 * 16 * 11_520 * 2
    # 385 tokens need a 25th block; float32 doubles the bytes
    assert batch_kv_cache_bytes(SMOLLM2, seqs=1, max_model_len=385, dtype="float32") == 26 * 16 * 11_520 * 4
    assert batch_kv_cache_bytes(QWEN3_4B, seqs=512, max_model_len=1024, block_size=32) == 512 * 33 * 32 * 73_728 * 2


def test_shared_prompts_hold_each_prompts_blocks_once():
    per_block = 16 * 11_520 * 2
    # 64 prompts x 8 samples of 256 + 128 tokens: 64 x 16 prompt blocks, 512 x (8 + 1), the null block
    assert shared_prompt_kv_cache_bytes(SMOLLM2, seqs=512, samples=8, max_model_len=384, response_len=128) \
        == (64 * 16 + 512 * 9 + 1) * per_block
    # a 1,600-token few-shot prompt at 16 x 8: one fifth of the full-length batch
    shared = shared_prompt_kv_cache_bytes(SMOLLM2, seqs=128, samples=8, max_model_len=1728, response_len=128)
    assert shared == (16 * 100 + 128 * 9 + 1) * per_block
    assert shared < batch_kv_cache_bytes(SMOLLM2, seqs=128, max_model_len=1728) / 5
    # one sample a prompt holds what the full-length sizing holds, give or take the last partial block
    single = shared_prompt_kv_cache_bytes(SMOLLM2, seqs=4, samples=1, max_model_len=40, response_len=8)
    assert single == (4 * 2 + 4 * 2 + 1) * per_block
    assert single >= batch_kv_cache_bytes(SMOLLM2, seqs=4, max_model_len=40) - per_block


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seqs": 12, "samples": 8, "max_model_len": 384, "response_len": 128},
         r"samples: expected a divisor of seqs \(12\), got 8"),
        ({"seqs": 16, "samples": 0, "max_model_len": 384, "response_len": 128},
         "samples: expected a positive integer, got 0"),
        ({"seqs": 16, "samples": 8, "max_model_len": 128, "response_len": 128},
         r"response_len: expected fewer tokens than max_model_len \(128\), got 128"),
    ],
)
def test_shared_sizing_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        shared_prompt_kv_cache_bytes(SMOLLM2, **kwargs)


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (SMOLLM2, {"seqs": 0, "max_model_len": 384}, "seqs: expected a positive integer, got 0"),
        (SMOLLM2, {"seqs": 8, "max_model_len": 384, "dtype": "int4"}, "dtype: expected one of"),
        ({"num_attention_heads": 9, "hidden_size": 576}, {"seqs": 8, "max_model_len": 384},
         "expected the key 'num_hidden_layers'"),
        ({**SMOLLM2, "num_key_value_heads": -1}, {"seqs": 8, "max_model_len": 384},
         "num_key_value_heads must be positive, got -1"),
        ({**SMOLLM2, "num_attention_heads": 0}, {"seqs": 8, "max_model_len": 384},
         "num_attention_heads must be positive, got 0"),
    ],
)
def test_bad_input_names_the_field(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        batch_kv_cache_bytes(config, **kwargs)


def test_the_command_prints_the_bytes_or_says_what_is_wrong(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    ok = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--seqs", "128", "--max-model-len", "384"],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == str(1_179_648_000), ok.stderr
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576}))
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--seqs", "1", "--max-model-len", "8"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "KV_CACHE_BYTES=batch" in bad.stderr and "num_hidden_layers" in bad.stderr
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    shared = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--seqs", "128", "--max-model-len", "384",
                             "--samples", "8", "--response-len", "128"], capture_output=True, text=True, check=False)
    assert shared.returncode == 0 and shared.stdout.strip() == str((16 * 16 + 128 * 9 + 1) * 16 * 11_520 * 2)
    alone = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--seqs", "128", "--max-model-len", "384",
                            "--samples", "8"], capture_output=True, text=True, check=False)
    assert alone.returncode == 2 and "--samples and --response-len go together" in alone.stderr
