"""On a CUDA device: the chunked LM head's values and gradients in bf16, and the memory it saves, as the
memory report (:mod:`arctic_rl.server.memory`) measures it. Skipped without CUDA.

Run on a GPU box: ``python -m pytest -q tests/arctic_rl/server/compute/test_chunked_head_gpu.py -s`` (prints the reports).
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl.server.compute import token_logprobs as logprobs_module
from arctic_rl.server.compute.token_logprobs import response_logprobs
from arctic_rl.server.memory import GIB, JobMemory
from arctic_rl.tiny_models import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB, ROWS, P, R = 151_936, 16, 64, 1024  # Qwen3's vocabulary: [16 x 1024 x 151936] bf16 logits are 4.6 GiB


def _pass(model, ids, mask, pos, chunk_bytes: int, monkeypatch) -> tuple[torch.Tensor, dict, dict]:
    monkeypatch.setattr(logprobs_module, "_HEAD_CHUNK_BYTES", chunk_bytes)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    tracker = JobMemory(ids.device)
    with tracker.tracking():
        out = response_logprobs(model, ids, mask, pos, P, temperature=0.8, calculate_entropy=True)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        torch.cuda.synchronize()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    report = tracker.report(model)
    print({k: round(v / GIB, 3) for k, v in report.items()})
    return out.logprobs.detach(), grads, report


def test_chunked_head_bf16_values_gradients_and_peak(monkeypatch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("qwen3", vocab_size=VOCAB, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                         max_position_embeddings=4096)
    device = torch.device("cuda")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, torch.bfloat16)
    ids = torch.randint(3, VOCAB, (ROWS, P + R), device=device)
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    lp, grads, whole = _pass(model, ids, mask, pos, 1 << 62, monkeypatch)
    lp_c, grads_c, chunked = _pass(model, ids, mask, pos, 256 << 20, monkeypatch)
    print("max |lp diff|", float((lp_c - lp).abs().max()))
    torch.testing.assert_close(lp_c, lp, rtol=0, atol=3e-2)  # bf16 logits: the same products, other blocking
    for name, grad in grads.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert (grads_c[name] - grad).abs().max() / scale < 5e-2, name
    for part in ("call_peak", "call_transient", "device_max_allocated", "device_reserved", "weights", "gradients"):
        assert whole[part] > 0 and chunked[part] > 0, part
    assert chunked["device_in_use"] >= chunked["device_reserved"]  # the driver's count covers the allocator's
    assert whole["largest_logits"] == ROWS * R * VOCAB * 2  # bf16
    assert chunked["largest_logits"] <= 256 << 20 and "largest_hidden_states" in chunked
    assert chunked["call_transient"] < whole["call_transient"] / 2  # the pass's peak without the whole logits
