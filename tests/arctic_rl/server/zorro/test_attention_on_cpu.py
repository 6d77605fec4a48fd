"""ZoRRO's attention wrapper (``arctic_rl/server/zorro/attention.py``): routing a model through it and back,
the per-thread pass state, and the refusals. The numbers of the passes that use it are checked in
``test_forward_on_cpu.py``."""

import pytest
import torch

from arctic_rl.server.zorro.attention import (
    PassState,
    ZorroUnsupportedError,
    attention_base,
    install_zorro_attention,
    routed_through_wrapper,
    running_pass,
)
from arctic_rl.server.zorro.forward import zorro_forward
from tests.support.zorro import make_batch, make_model

torch.set_num_threads(1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_model_is_routed_through_the_wrapper_for_the_passes_only(attn):
    model = make_model("qwen3", attn)
    with routed_through_wrapper(model):
        assert model.config._attn_implementation == f"arctic_rl_zorro_{attn}"
        assert attention_base(model) == attn  # the wrapper counts as what it wraps
        with routed_through_wrapper(model):  # a second pass in flight on the same model
            pass
        assert model.config._attn_implementation == f"arctic_rl_zorro_{attn}"  # the outer one still runs
    assert model.config._attn_implementation == attn


def test_outside_a_pass_the_wrapper_is_the_base_attention():
    model = make_model("llama", "sdpa").eval()
    ids, mask, pos = make_batch(2, 2, 5, 3, seed=1)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        install_zorro_attention(model)
        wrapped = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert model.config._attn_implementation == "arctic_rl_zorro_sdpa"
    torch.testing.assert_close(wrapped, plain, rtol=0, atol=0)


def test_passes_do_not_nest_and_the_state_is_cleared_after_a_failure():
    refused = pytest.raises(RuntimeError, match="inside another zorro_forward")
    with running_pass(PassState()), refused, running_pass(PassState()):  # the second pass is refused on entry
        pass
    with pytest.raises(ValueError, match="boom"), running_pass(PassState()):
        raise ValueError("boom")
    with running_pass(PassState()) as state:  # nothing left behind by the failed pass
        assert state.collected == {}


def test_a_zorro_forward_inside_a_pass_is_refused():
    model = make_model("qwen3").eval()
    batch = make_batch(2, 2, 5, 3, seed=2)
    refused = pytest.raises(RuntimeError, match="inside another zorro_forward")
    with torch.no_grad(), running_pass(PassState()), refused:
        zorro_forward(model, *batch, 5)


def test_an_attention_implementation_without_a_wrapper_is_named_in_the_refusal():
    model = make_model("qwen3", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ZorroUnsupportedError, match=r"attn_implementation is 'flash_attention_2'.*\['eager', 'sdpa'\]"):
        install_zorro_attention(model)
