"""ZoRRO's grouped FlexAttention response pass on a GPU: values *and gradients* equal the plain pass.

FlexAttention has no CPU backward, so ``tests/arctic_rl/server/zorro/test_forward_on_cpu.py`` can compare only the forward
of this path; here the compiled kernels run forward and backward on CUDA (fp32, tiny models),
alone and inside whole-layer ``torch.compile`` as the reference server runs them. Skipped without
a CUDA device (run on a GPU box: ``python -m pytest tests/arctic_rl/server/zorro/test_zorro_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl.server.compute.token_logprobs import response_logprobs
from arctic_rl.server.engines.common import compile_model
from arctic_rl.server.zorro import flex as zorro_flex
from arctic_rl.server.zorro.flex import set_response_attention
from tests.support.zorro import ARCHS, LAYOUTS, make_batch, make_model, rel_err

pytestmark = pytest.mark.gpu
RTOL = 1e-4  # fp32 on a GPU: different kernels, different summation orders


def run(model, batch, prompt_len: int, *, zorro: bool):
    """Log-probs, entropy, a loss mixing both with per-token weights, and all parameter gradients."""
    ids, mask, pos = batch
    model.zero_grad(set_to_none=True)
    out = response_logprobs(model, ids, mask, pos, prompt_len, temperature=0.7, calculate_entropy=True, zorro=zorro)
    weights = torch.linspace(-1.0, 1.0, out.logprobs.numel(), device=ids.device).view_as(out.logprobs)
    response_mask = mask[:, prompt_len:].float()
    loss = ((weights * out.logprobs + 0.01 * out.entropy) * response_mask).sum() / response_mask.sum()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out, loss.detach(), grads


@pytest.fixture
def flex_compiled():
    set_response_attention("flex", compiled=True)
    yield
    set_response_attention("expand")


#: (prompt, response) widths: block-aligned (FlexAttention's 128) and ragged
SHAPES = {"aligned": (128, 64), "ragged": (40, 24)}


@pytest.mark.parametrize(
    "arch, layout, shape, compile_layers",
    [(arch, "groups_of_4", "aligned", False) for arch in ARCHS]
    + [("qwen3", "groups_of_4", "ragged", False), ("qwen3", "non_adjacent", "ragged", True),
       ("qwen3", "repeated_prompt", "ragged", True)],
)
def test_flex_response_pass_matches_plain_with_gradients(arch, layout, shape, compile_layers, flex_compiled,
                                                         monkeypatch):
    calls = []
    real = zorro_flex.grouped_attention
    monkeypatch.setattr(zorro_flex, "grouped_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch._dynamo.reset()
    # repeated_prompt: two of four groups drew the same prompt (6, 3, 3 rows: its keys lent to two groups of 3)
    spec = LAYOUTS.get(layout, {"num_prompts": 4, "n": 3, "shuffle": True, "same_prompt": {2: 0}})
    prompt_len, resp_len = SHAPES[shape]
    batch = make_batch(spec["num_prompts"], spec["n"], prompt_len, resp_len, seed=3, shuffle=spec["shuffle"],
                       same_prompt=spec.get("same_prompt"))
    batch = tuple(t.cuda() for t in batch)
    # FlexAttention's GPU kernels want head_dim >= 16
    model = make_model(arch, "sdpa", hidden_size=128, head_dim=32).cuda()
    if compile_layers:
        compile_model(model, "layers")
    plain, plain_loss, plain_grads = run(model, batch, prompt_len, zorro=False)
    zorro, zorro_loss, zorro_grads = run(model, batch, prompt_len, zorro=True)
    assert zorro_flex.response_attention()[0] == "flex"  # no fallback to the expanding pass
    assert len(calls) == model.config.num_hidden_layers
    assert rel_err(zorro.logprobs, plain.logprobs) <= RTOL
    assert rel_err(zorro.entropy, plain.entropy) <= RTOL
    assert rel_err(zorro_loss, plain_loss) <= RTOL
    assert rel_err(zorro_grads, plain_grads) <= RTOL


def test_flex_pass_does_not_recompile_for_every_shape(flex_compiled):
    """Training batches change their response width every step: after the second shape, the
    compiled FlexAttention kernels and block-mask builder are shape-generic and compile no more."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model("qwen3", "sdpa", hidden_size=128, head_dim=32).cuda()
    graphs = []
    for resp_len in (24, 40, 56, 72, 88):
        batch = tuple(t.cuda() for t in make_batch(3, 4, 40, resp_len, seed=resp_len))
        run(model, batch, 40, zorro=True)
        graphs.append(counters["stats"]["unique_graphs"])
    assert zorro_flex.response_attention()[0] == "flex"
    assert graphs[-1] == graphs[2], graphs
