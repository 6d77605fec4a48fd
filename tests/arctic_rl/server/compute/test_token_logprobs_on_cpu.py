"""Log-prob / entropy computation of the reference server against a direct computation.

The direct computation is the textbook one: the model's full ``logits``, divided by the temperature,
``log_softmax`` and ``gather`` at the next token. The module under test only asks for the logits it
needs and works a few rows at a time; both must agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from arctic_rl.server.compute import token_logprobs as logprobs_module
from arctic_rl.server.compute.token_logprobs import TokenLogprobs, response_logprobs, shifted_logprobs, to_shifted
from arctic_rl.tiny_models import tiny_config

torch.set_num_threads(1)

VOCAB = 37
P, R = 6, 5


def make_model(arch: str = "qwen3", seed: int = 0) -> torch.nn.Module:
    config = tiny_config(arch, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4 rows of ``[left-padded prompt | right-padded response]`` with varying lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, resp_lens = [6, 3, 1, 4], [5, 2, 0, 4]
    ids = torch.zeros(4, P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (pl, rl) in enumerate(zip(prompt_lens, resp_lens, strict=True)):
        ids[row, P - pl : P + rl] = torch.randint(3, VOCAB, (pl + rl,), generator=g)
        mask[row, P - pl : P + rl] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def direct(model, ids, mask, pos, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted ``[B, T-1]`` log-probs and entropy straight from the full logits."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float() / temperature
    logp = F.log_softmax(logits[:, :-1], dim=-1)
    lp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_response_logprobs_equal_direct_computation(arch, temperature):
    model = make_model(arch)
    ids, mask, pos = make_batch()
    with torch.no_grad():
        out = response_logprobs(model, ids, mask, pos, P, temperature=temperature, calculate_entropy=True)
        lp, ent = direct(model, ids, mask, pos, temperature)
    assert isinstance(out, TokenLogprobs)
    assert out.logprobs.shape == (4, R) and out.logprobs.dtype == torch.float32
    assert out.unique_prompts == 4 and out.tokens_computed == 4 * (P + R)
    torch.testing.assert_close(out.logprobs, lp[:, P - 1 :], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy, ent[:, P - 1 :], rtol=1e-5, atol=1e-6)


def test_temperature_is_applied():
    model = make_model()
    ids, mask, pos = make_batch()
    with torch.no_grad():
        cold = response_logprobs(model, ids, mask, pos, P, temperature=0.5, calculate_entropy=True)
        warm = response_logprobs(model, ids, mask, pos, P, temperature=2.0, calculate_entropy=True)
    assert not torch.allclose(cold.logprobs, warm.logprobs)
    assert bool((warm.entropy > cold.entropy).all())  # a hotter distribution is flatter
    assert cold.entropy.max() <= torch.log(torch.tensor(float(VOCAB))) + 1e-5


def test_shifted_logprobs_agree_with_response_logprobs():
    model = make_model("qwen2")
    ids, mask, pos = make_batch(seed=1)
    with torch.no_grad():
        lp, ent = shifted_logprobs(model, ids, mask, pos, temperature=0.8, calculate_entropy=True)
        ref_lp, ref_ent = direct(model, ids, mask, pos, 0.8)
        resp = response_logprobs(model, ids, mask, pos, P, temperature=0.8, calculate_entropy=True)
    assert lp.shape == ids.shape and ent.shape == ids.shape
    assert bool((lp[:, -1] == 0).all()) and bool((ent[:, -1] == 0).all())
    torch.testing.assert_close(lp[:, :-1], ref_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent[:, :-1], ref_ent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp[:, P - 1 : P - 1 + R], resp.logprobs, rtol=1e-5, atol=1e-6)
    response_columns = torch.zeros_like(lp, dtype=torch.bool)
    response_columns[:, P - 1 : P - 1 + R] = True
    placed = to_shifted(resp.logprobs, P, P + R)
    torch.testing.assert_close(placed[response_columns], lp[response_columns], rtol=1e-5, atol=1e-6)
    assert bool((placed[~response_columns] == 0).all())


def test_to_shifted_layout_and_gradient():
    resp = torch.arange(1.0, 7.0).reshape(2, 3).requires_grad_()
    placed = to_shifted(resp, 2, 5)
    assert placed.tolist() == [[0, 1, 2, 3, 0], [0, 4, 5, 6, 0]]
    placed.sum().backward()
    assert resp.grad.tolist() == [[1.0] * 3] * 2
    with pytest.raises(ValueError, match="total_len"):
        to_shifted(resp, 2, 6)
    with pytest.raises(ValueError, match="resp_lp"):
        to_shifted(torch.zeros(3), 1, 4)


def test_gradients_match_direct_computation():
    ids, mask, pos = make_batch(seed=2)
    weights = torch.linspace(-1.0, 1.0, R).expand(4, R) * mask[:, P:]
    model = make_model("llama")
    out = response_logprobs(model, ids, mask, pos, P, temperature=0.9, calculate_entropy=True)
    assert out.logprobs.requires_grad
    ((out.logprobs + 0.1 * out.entropy) * weights).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    lp, ent = direct(model, ids, mask, pos, 0.9)
    ((lp[:, P - 1 :] + 0.1 * ent[:, P - 1 :]) * weights).sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def test_row_chunking_gives_the_same_values(monkeypatch):
    model = make_model()
    ids, mask, pos = make_batch(seed=3)
    with torch.no_grad():
        whole = response_logprobs(model, ids, mask, pos, P, calculate_entropy=True)
        monkeypatch.setattr(logprobs_module, "_FP32_CHUNK_BYTES", 1)  # one row at a time
        rows = response_logprobs(model, ids, mask, pos, P, calculate_entropy=True)
    torch.testing.assert_close(rows.logprobs, whole.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(rows.entropy, whole.entropy, rtol=0, atol=0)


def test_bad_inputs_name_the_field():
    model = make_model()
    ids, mask, pos = make_batch()
    with pytest.raises(ValueError, match="attention_mask.*expected shape"):
        response_logprobs(model, ids, mask[:, 1:], pos, P)
    with pytest.raises(ValueError, match="position_ids"):
        shifted_logprobs(model, ids, mask, pos[:2])
    with pytest.raises(ValueError, match="input_ids.*int64"):
        response_logprobs(model, ids.float(), mask, pos, P)
    with pytest.raises(ValueError, match="prompt_len"):
        response_logprobs(model, ids, mask, pos, P + R)
    with pytest.raises(ValueError, match="temperature"):
        response_logprobs(model, ids, mask, pos, P, temperature=0.0)


@pytest.mark.parametrize("want_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_stats_gradcheck_in_chunks(monkeypatch, temperature, want_entropy):
    """The hand-written backward of the log-prob/entropy kernel, rows split over several chunks."""
    monkeypatch.setattr(logprobs_module, "_FP32_CHUNK_BYTES", 2 * 3 * 5 * 4)  # two rows per chunk
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (5, 3), generator=g)

    def fn(x):
        lp, ent = logprobs_module._token_stats(x, targets, temperature, want_entropy)
        return (lp, ent) if want_entropy else lp

    assert torch.autograd.gradcheck(fn, (logits,))
    lp, ent = logprobs_module._token_stats(logits, targets, temperature, True)
    reference = F.log_softmax(logits / temperature, dim=-1)
    torch.testing.assert_close(lp, reference.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(ent, -(reference.exp() * reference).sum(-1))
    ent.sum().backward()  # entropy alone (no gradient flows into the log-probs)
    reference_grad = torch.autograd.grad(-(reference.exp() * reference).sum(), logits)[0]
    torch.testing.assert_close(logits.grad, reference_grad)
