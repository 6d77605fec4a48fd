"""The LM head run chunk by chunk on hidden states (:mod:`arctic_rl.server.compute.chunked_head`).

On real tiny models with a vocabulary large enough to take several chunks, the chunked path must give
today's log-probs, entropy and parameter gradients (plain and ZoRRO passes, the loss path and the
``/forward`` path, ``response_logprobs_only`` included) while no pass holds the whole logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl.protocol import BatchMeta, Features
from arctic_rl.server.compute import token_logprobs as logprobs_module
from arctic_rl.server.compute.chunked_head import chunked_head_supported, hidden_states_out
from arctic_rl.server.compute.token_logprobs import response_logprobs, shifted_logprobs
from arctic_rl.server.engines.common import forward_logprobs
from arctic_rl.server.http.validation import parse_batch_body
from arctic_rl.server.memory import JobMemory
from arctic_rl.tiny_models import tiny_config

torch.set_num_threads(1)

VOCAB = 3000
P, R = 6, 5
#: fp32 bytes of 7 positions' logits: the 20 response positions take 3 chunks, the 40 shifted ones 6
SMALL_CHUNK = 7 * VOCAB * 4


def make_model(arch: str, seed: int = 0, **extra) -> torch.nn.Module:
    config = tiny_config(arch, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         tie_word_embeddings=arch != "llama")
    for key, value in extra.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def make_batch(seed: int = 0, groups: int = 2, n: int = 2):
    """``groups * n`` rows of ``[left-padded prompt | right-padded response]``; rows of a group share the prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = groups * n
    ids = torch.zeros(rows, P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for group in range(groups):
        pl = P - 2 * group
        prompt = torch.randint(3, VOCAB, (pl,), generator=g)
        for k in range(n):
            row, rl = group * n + k, R - k
            ids[row, P - pl: P] = prompt
            ids[row, P: P + rl] = torch.randint(3, VOCAB, (rl,), generator=g)
            mask[row, P - pl: P + rl] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def _run(model, zorro: bool, chunk_bytes: int, monkeypatch):
    monkeypatch.setattr(logprobs_module, "_HEAD_CHUNK_BYTES", chunk_bytes)
    ids, mask, pos = make_batch()
    model.zero_grad()
    tracker = JobMemory(torch.device("cpu"))
    with tracker.tracking():
        out = response_logprobs(model, ids, mask, pos, P, temperature=0.7, calculate_entropy=True, zorro=zorro)
    weights = torch.linspace(-1.0, 1.0, out.logprobs.numel()).reshape(out.logprobs.shape)
    ((out.logprobs * weights * mask[:, P:]).sum() + 0.3 * (out.entropy * mask[:, P:]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), out.entropy.detach(), grads, tracker.buffers


@pytest.mark.parametrize("zorro", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_chunked_head_gives_todays_values_and_gradients(arch, zorro, monkeypatch):
    model = make_model(arch)
    assert chunked_head_supported(model)
    lp, ent, grads, whole = _run(model, zorro, 1 << 40, monkeypatch)  # one chunk: today's whole-logits path
    lp_c, ent_c, grads_c, chunked = _run(model, zorro, SMALL_CHUNK, monkeypatch)
    torch.testing.assert_close(lp_c, lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_c, ent, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads.keys() and any(n.endswith(("lm_head.weight", "embed_tokens.weight")) for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # today's path holds the whole [positions, V] logits; the chunked one at most one chunk, from hidden states
    rows, positions = 4, 4 * R
    assert whole["largest_logits"] >= positions * VOCAB * 4 - rows * VOCAB * 4  # fp32 model: 4 bytes a logit
    assert chunked["largest_logits"] <= SMALL_CHUNK and chunked["largest_logits_fp32_chunk"] <= SMALL_CHUNK
    assert chunked["largest_hidden_states"] <= positions * 32 * 4
    assert "largest_hidden_states" not in whole


def test_shifted_and_response_only_forward_equal_the_whole_logits(monkeypatch):
    """``/forward`` without ZoRRO: every position (chunked) equals today's; ``response_logprobs_only`` gives the
    same values at the response's columns and zeros elsewhere."""
    model = make_model("qwen3").eval()
    ids, mask, pos = make_batch()
    with torch.no_grad():
        want_lp, want_ent = shifted_logprobs(model, ids, mask, pos, temperature=0.7, calculate_entropy=True)
        monkeypatch.setattr(logprobs_module, "_HEAD_CHUNK_BYTES", SMALL_CHUNK)
        got_lp, got_ent = shifted_logprobs(model, ids, mask, pos, temperature=0.7, calculate_entropy=True)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-6)

    def forward(response_only: bool):
        body = {"batch": {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "prompts": ids[:, :P]},
                "meta": {"temperature": 0.7, "calculate_entropy": True, "response_logprobs_only": response_only},
                "processing": {"post": ["apply_temperature"]}}
        batch = parse_batch_body(body, vocab_size=VOCAB, train=False)
        tensors, _, alignment = forward_logprobs(model, batch, zorro=False, temperature=0.7)
        return tensors["logprobs"], tensors["entropy"], alignment.value

    full_lp, full_ent, alignment = forward(False)
    resp_lp, resp_ent, resp_alignment = forward(True)
    assert alignment == resp_alignment == "shifted"
    torch.testing.assert_close(full_lp, want_lp, rtol=1e-5, atol=1e-6)
    response_cols = slice(P - 1, P + R - 1)
    torch.testing.assert_close(resp_lp[:, response_cols], full_lp[:, response_cols], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resp_ent[:, response_cols], full_ent[:, response_cols], rtol=1e-5, atol=1e-6)
    assert not resp_lp[:, : P - 1].any() and not resp_lp[:, -1].any() and full_lp[:, : P - 1].any()
    assert BatchMeta().response_logprobs_only is False and Features.RESPONSE_LOGPROBS == "response_logprobs"


def test_only_plain_projection_heads_are_chunked():
    """Soft-capped or scaled logits are not ``lm_head``'s output alone: such models keep the whole logits."""
    assert not chunked_head_supported(make_model("qwen3", final_logit_softcapping=30.0))
    assert not chunked_head_supported(make_model("llama", logits_scaling=2.0))
    model = make_model("qwen2")
    head = model.lm_head
    with hidden_states_out(model, True) as got:
        assert got is head and isinstance(model.lm_head, torch.nn.Identity)
    assert model.lm_head is head  # restored
    with hidden_states_out(model, False) as got:
        assert got is None and model.lm_head is head
