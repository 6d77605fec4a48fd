"""ZoRRO's FlexAttention response pass (``arctic_rl/server/zorro/flex.py``): the choice of pass and the
one-off kernel probe. Its numbers against the plain pass are checked with the passes themselves
(``test_forward_on_cpu.py``; gradients on a GPU, ``test_zorro_gpu.py``)."""

import pytest
import torch

from arctic_rl.server.zorro import flex as zorro_flex

torch.set_num_threads(1)


def test_the_response_pass_is_chosen_by_name_and_a_bad_name_is_refused():
    try:
        zorro_flex.set_response_attention("flex", compiled=False)
        assert zorro_flex.response_attention() == ("flex", False)
        with pytest.raises(ValueError, match=r"expected one of \['expand', 'flex'\], got 'dense'"):
            zorro_flex.set_response_attention("dense")
        assert zorro_flex.response_attention() == ("flex", False)  # a refused name changes nothing
    finally:
        zorro_flex.set_response_attention("expand")


def test_the_flex_probe_differentiates_even_when_the_first_zorro_pass_has_no_grad(monkeypatch):
    """A job's first ZoRRO pass is often a no-grad ``/forward``: the probe of FlexAttention's backward must not
    fail there (it did, and ruled FlexAttention out for the process). The compiled kernel is GPU-only, so a
    differentiable stand-in takes its place; what is checked is the grad mode the probe runs in."""
    monkeypatch.setattr(zorro_flex, "group_block_mask", lambda *args, **kwargs: None)
    monkeypatch.setattr(zorro_flex, "_flex_attention", lambda compiled: lambda q, k, v, **kwargs: q * k.mean() * v.mean())
    monkeypatch.setattr(zorro_flex, "_FLEX_PROBE", {})
    with torch.no_grad():
        assert zorro_flex.flex_failure(torch.device("cpu"), torch.float32, 4, 2, 8) is None
    monkeypatch.setattr(zorro_flex, "_FLEX_PROBE", {})
    monkeypatch.setattr(zorro_flex, "_flex_attention", lambda compiled: lambda q, k, v, **kwargs: q.detach())
    assert "does not require grad" in zorro_flex.flex_failure(torch.device("cpu"), torch.float32, 4, 2, 8)
