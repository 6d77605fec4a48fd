"""ZoRRO prompt deduplication: grouping, and equality with the plain pass for several model families.

Every equivalence test runs the same batch through the plain ``[B, P+R]`` forward and through
ZoRRO's shared-prompt forward and compares log-probs, entropy, a GRPO loss with every option on,
and all parameter gradients (max relative error <= 1e-5, fp32). Batches use the protocol's layout:
left-padded prompts of varying length, right-padded responses of varying length (some fully
padded), with ``rollout_n`` rows per prompt.
"""

from __future__ import annotations

import logging

import pytest
import torch

from arctic_rl.protocol import LossConfig
from arctic_rl.server.compute.losses import compute_loss
from arctic_rl.server.compute.token_logprobs import response_logprobs
from arctic_rl.server.zorro import flex as zorro_flex
from arctic_rl.server.zorro.flex import set_response_attention
from arctic_rl.server.zorro.forward import ZorroUnsupportedError, group_prompts, zorro_forward, zorro_unsupported_reason
from tests.support.zorro import ARCHS, ATTNS, LAYOUTS, RTOL, VOCAB, make_batch, make_model, rel_err

torch.set_num_threads(1)

def rl_tensors(lp: torch.Tensor, mask: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """Response-sliced RL tensors around the current log-probs (so clipping and KL are active)."""
    g = torch.Generator().manual_seed(seed)
    b, r = lp.shape
    lp = lp.detach()
    return {
        "response_mask": mask,
        "old_log_probs": lp + 0.4 * torch.randn(b, r, generator=g),
        "ref_log_prob": lp + 0.4 * torch.randn(b, r, generator=g),
        "advantages": torch.randn(b, 1, generator=g).expand(b, r).contiguous(),
        "rollout_is_weights": 0.5 + torch.rand(b, r, generator=g),
    }


ALL_OPTIONS = LossConfig(
    clip_ratio_low=0.1,
    clip_ratio_high=0.28,
    clip_ratio_c=2.0,
    loss_agg_mode="seq-mean-token-mean",
    use_kl_loss=True,
    kl_loss_coef=0.1,
    kl_loss_type="low_var_kl",
    entropy_coeff=0.01,
)


def run(model, batch, prompt_len, *, zorro: bool, temperature: float = 0.7):
    ids, mask, pos = batch
    model.zero_grad(set_to_none=True)
    out = response_logprobs(
        model, ids, mask, pos, prompt_len, temperature=temperature, calculate_entropy=True, zorro=zorro
    )
    rl = rl_tensors(out.logprobs, mask[:, prompt_len:])
    loss, metrics = compute_loss("verl_grpo", out, rl, ALL_OPTIONS)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out, loss.detach(), metrics, grads


# --------------------------------------------------------------------------------------------
# group_prompts
# --------------------------------------------------------------------------------------------


def test_group_prompts_adjacent_groups():
    ids, mask, _pos = make_batch(3, 4, 6, 5, seed=1)
    unique, groups = group_prompts(ids, mask, 6)
    assert unique.tolist() == [0, 4, 8]
    assert groups.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_group_prompts_non_adjacent_numbered_by_first_row():
    ids = torch.tensor([[5, 6, 1, 2], [7, 8, 1, 3], [5, 6, 4, 4], [9, 9, 0, 0], [7, 8, 2, 2]])
    mask = torch.ones_like(ids)
    unique, groups = group_prompts(ids, mask, 2)
    assert unique.tolist() == [0, 1, 3]
    assert groups.tolist() == [0, 1, 0, 2, 1]
    assert torch.equal(groups[unique], torch.arange(3))


def test_group_prompts_mask_and_positions_are_part_of_the_key():
    ids = torch.tensor([[0, 5, 6, 1], [0, 5, 6, 2], [0, 5, 6, 3]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    _unique, groups = group_prompts(ids, mask, 3)
    assert groups.tolist() == [0, 1, 0]
    pos = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3], [0, 5, 6, 7]])
    _, groups = group_prompts(ids, mask, 3, position_ids=pos)
    assert groups.tolist() == [0, 1, 2]


def test_group_prompts_all_unique_and_single_group():
    ids, mask, _ = make_batch(5, 1, 4, 3, seed=2)
    unique, groups = group_prompts(ids, mask, 4)
    assert unique.tolist() == list(range(5)) and groups.tolist() == list(range(5))
    ids, mask, _ = make_batch(1, 6, 4, 3, seed=2)
    unique, groups = group_prompts(ids, mask, 4)
    assert unique.tolist() == [0] and groups.tolist() == [0] * 6


@pytest.mark.parametrize("prompt_len", [0, 7, -1])
def test_group_prompts_rejects_bad_prompt_len(prompt_len):
    ids, mask, _ = make_batch(2, 2, 4, 3)
    with pytest.raises(ValueError, match="prompt_len"):
        group_prompts(ids, mask, prompt_len)


# --------------------------------------------------------------------------------------------
# Equivalence with the plain pass
# --------------------------------------------------------------------------------------------



@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_zorro_equals_plain_pass(arch, attn, layout):
    spec = LAYOUTS[layout]
    prompt_len, resp_len = 7, 6
    batch = make_batch(spec["num_prompts"], spec["n"], prompt_len, resp_len, seed=3, shuffle=spec["shuffle"])
    model = make_model(arch, attn)
    plain, plain_loss, plain_metrics, plain_grads = run(model, batch, prompt_len, zorro=False)
    zorro, zorro_loss, zorro_metrics, zorro_grads = run(model, batch, prompt_len, zorro=True)

    b = batch[0].shape[0]
    assert plain.unique_prompts == b and plain.tokens_computed == b * (prompt_len + resp_len)
    assert zorro.unique_prompts == spec["num_prompts"]
    assert zorro.tokens_computed == spec["num_prompts"] * prompt_len + b * resp_len
    # every position, padding included: the padding is handled the same way on both paths
    assert rel_err(zorro.logprobs, plain.logprobs) <= RTOL
    assert rel_err(zorro.entropy, plain.entropy) <= RTOL
    assert rel_err(zorro_loss, plain_loss) <= RTOL
    assert plain_metrics["actor/pg_clipfrac"] > 0 and plain_metrics["kl_loss"] > 0  # the options really acted
    assert zorro_metrics["actor/pg_clipfrac"] == pytest.approx(plain_metrics["actor/pg_clipfrac"])
    assert zorro_grads.shape == plain_grads.shape
    assert rel_err(zorro_grads, plain_grads) <= RTOL


@pytest.fixture
def flex_response_attention():
    """ZoRRO's grouped FlexAttention response pass (uncompiled: the reference implementation)."""
    set_response_attention("flex", compiled=False)
    yield
    set_response_attention("expand")


@pytest.mark.parametrize("layout", ["groups_of_4", "non_adjacent", "single_group"])
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_flex_response_attention_equals_plain_pass(arch, attn, layout, flex_response_attention, monkeypatch):
    """The grouped response pass gives the plain pass's values (forward: FlexAttention has no CPU
    backward; its gradients are compared on a GPU by ``tests/arctic_rl/server/zorro/test_zorro_gpu.py``)."""
    calls = []
    real = zorro_flex.grouped_attention
    monkeypatch.setattr(zorro_flex, "grouped_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = LAYOUTS[layout]
    batch = make_batch(spec["num_prompts"], spec["n"], 7, 6, seed=3, shuffle=spec["shuffle"])
    model = make_model(arch, attn).eval()
    with torch.no_grad():
        plain = response_logprobs(model, *batch, 7, temperature=0.7, calculate_entropy=True)
        zorro = response_logprobs(model, *batch, 7, temperature=0.7, calculate_entropy=True, zorro=True)
    assert len(calls) == model.config.num_hidden_layers  # every layer took the grouped path
    assert rel_err(zorro.logprobs, plain.logprobs) <= RTOL
    assert rel_err(zorro.entropy, plain.entropy) <= RTOL
    # CPU passes with gradients take the expanding path instead
    calls.clear()
    with_grad = response_logprobs(model, *batch, 7, temperature=0.7, zorro=True)
    assert not calls and rel_err(with_grad.logprobs, plain.logprobs) <= RTOL


@pytest.mark.parametrize("arch", ARCHS)
def test_flex_groups_prompts_with_unequal_row_counts(arch, flex_response_attention, monkeypatch):
    """Prompts with different row counts still take the grouped pass, in groups of the counts' greatest common
    divisor: a prompt that two GRPO groups drew (6, 3, 3 rows: groups of 3, the first prompt's keys lent to two
    groups) and counts with no common divisor (3 and 2 rows: groups of one row)."""
    sizes = []
    real = zorro_flex.grouped_attention
    monkeypatch.setattr(zorro_flex, "grouped_attention",
                        lambda *a, **k: sizes.append((a[3].shape[0], k["group_size"])) or real(*a, **k))
    model = make_model(arch, "sdpa").eval()
    repeated = make_batch(4, 3, 7, 6, seed=5, shuffle=True, same_prompt={2: 0})
    coprime = tuple(t[:5] for t in make_batch(2, 3, 7, 6, seed=9))
    for batch, unique, groups in ((repeated, 3, (4, 3)), (coprime, 2, (5, 1))):
        sizes.clear()
        with torch.no_grad():
            plain = response_logprobs(model, *batch, 7, temperature=0.7, calculate_entropy=True)
            zorro = response_logprobs(model, *batch, 7, temperature=0.7, calculate_entropy=True, zorro=True)
        assert zorro.unique_prompts == unique
        assert sizes == [groups] * model.config.num_hidden_layers  # every layer took the grouped path, so grouped
        assert rel_err(zorro.logprobs, plain.logprobs) <= RTOL
        assert rel_err(zorro.entropy, plain.entropy) <= RTOL


@pytest.mark.parametrize("arch", ARCHS)
def test_zorro_no_grad_and_token_mean(arch):
    model = make_model(arch, "sdpa", seed=1).eval()
    batch = make_batch(2, 4, 5, 4, seed=4)
    with torch.no_grad():
        plain = response_logprobs(model, *batch, 5, zorro=False)
        zorro = response_logprobs(model, *batch, 5, zorro=True)
    assert not zorro.logprobs.requires_grad and zorro.entropy is None
    assert rel_err(zorro.logprobs, plain.logprobs) <= RTOL


def test_zorro_single_response_token():
    model = make_model("qwen3")
    batch = make_batch(2, 3, 5, 1, seed=5)
    plain = response_logprobs(model, *batch, 5, calculate_entropy=True)
    zorro = response_logprobs(model, *batch, 5, calculate_entropy=True, zorro=True)
    assert zorro.logprobs.shape == (6, 1)
    assert zorro.tokens_computed == 2 * 5  # the responses need no pass of their own
    assert rel_err(zorro.logprobs, plain.logprobs) <= RTOL
    assert rel_err(zorro.entropy, plain.entropy) <= RTOL


def test_zorro_output_shapes():
    model = make_model("llama")
    ids, mask, pos = make_batch(2, 3, 5, 4, seed=6)
    out = zorro_forward(model, ids, mask, pos, 5)
    assert out.first_logits.shape == (2, VOCAB)
    assert out.rest_logits.shape == (6, 3, VOCAB)
    assert out.row_to_group.tolist() == [0, 0, 0, 1, 1, 1]
    assert out.tokens_computed == 2 * 5 + 6 * 4


# --------------------------------------------------------------------------------------------
# Models that cannot take the shared-prompt path
# --------------------------------------------------------------------------------------------


def test_gradient_checkpointing_is_refused_and_falls_back(caplog):
    model = make_model("qwen3")
    batch = make_batch(2, 3, 5, 4, seed=7)
    expected = response_logprobs(model, *batch, 5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "gradient checkpointing" in zorro_unsupported_reason(model)
    with pytest.raises(ZorroUnsupportedError, match="gradient checkpointing"):
        zorro_forward(model, *batch, 5)
    with caplog.at_level(logging.WARNING, logger="arctic_rl.server.compute.token_logprobs"):
        out = response_logprobs(model, *batch, 5, zorro=True)
    assert "ZoRRO requested but not possible" in caplog.text
    assert out.unique_prompts == 6
    assert rel_err(out.logprobs, expected.logprobs) <= RTOL
    model.eval()  # checkpointing is inactive outside training: the cache path is fine again
    assert zorro_unsupported_reason(model) is None


def test_sliding_window_cache_is_refused():
    model = make_model(
        "qwen2", use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    reason = zorro_unsupported_reason(model)
    assert reason is not None and "sliding" in reason.lower()
    batch = make_batch(2, 2, 6, 3, seed=8)
    with pytest.raises(ZorroUnsupportedError):
        zorro_forward(model, *batch, 6)
    out = response_logprobs(model, *batch, 6, zorro=True)  # falls back to the plain pass
    assert out.unique_prompts == 4


def test_the_layer_check_runs_once_per_model(monkeypatch):
    """The cache-layer verdict is kept per model; a micro-batch does not build a cache to re-learn it."""
    import transformers

    sliding = make_model(
        "qwen2", use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    full = make_model("qwen3")
    first = (zorro_unsupported_reason(sliding), zorro_unsupported_reason(full))
    assert first[0] is not None and first[1] is None

    def no_cache(*args, **kwargs):
        raise AssertionError("DynamicCache built again for a model already checked")

    monkeypatch.setattr(transformers, "DynamicCache", no_cache)
    assert (zorro_unsupported_reason(sliding), zorro_unsupported_reason(full)) == first


def test_flex_failure_falls_back_to_the_expanding_pass(flex_response_attention, monkeypatch, caplog):
    """A FlexAttention kernel that cannot be built (shape, GPU, compiler) costs a warning, not the request."""
    def broken(*args, **kwargs):
        raise RuntimeError("no valid kernel for this shape")

    monkeypatch.setattr(zorro_flex, "grouped_attention", broken)
    model = make_model("qwen3").eval()
    batch = make_batch(2, 3, 6, 5, seed=11)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="arctic_rl.server.zorro.forward"):
        plain = response_logprobs(model, *batch, 6)
        zorro = response_logprobs(model, *batch, 6, zorro=True)
    assert "FlexAttention response pass failed (RuntimeError: no valid kernel for this shape)" in caplog.text
    assert zorro_flex.response_attention()[0] == "expand"
    assert rel_err(zorro.logprobs, plain.logprobs) <= RTOL
