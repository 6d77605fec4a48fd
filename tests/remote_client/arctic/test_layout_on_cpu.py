"""ZoRRO/verl batch layout conversions of the Arctic adapter (verl/workers/remote_client/arctic/layout.py).

Batches are built the way verl 0.9.1 builds them: a left/right-padded DataProto-style TensorDict
(``tu.get_tensordict``) turned nested by verl's own ``left_right_2_no_padding`` (legacy trainer),
or nested per-row fields (V1 trainer); see ``tests/support/arctic.py``. Results are read back with verl's own
``no_padding_2_padding`` / ``response_from_nested``, so the test checks the contract verl relies on.
"""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

from tests.support.arctic import PAD, grpo_rows, legacy_batch, v1_batch
from verl.remote_backend.errors import RemoteBackendConfigError, RemoteProtocolError
from verl.workers.remote_client.arctic.layout import (
    dense_batch,
    group_spans,
    nested_from_server,
    plan_layout,
    shuffled_rows,
    split_rows,
)


def fake_shifted(batch: dict) -> torch.Tensor:
    """A server's shifted log-probs: lp[:, c] depends on tokens c and c+1 (a causal model's view)."""
    ids = batch["input_ids"].double()
    lp = torch.zeros_like(ids)
    lp[:, :-1] = -(ids[:, 1:] + 0.01 * ids[:, :-1]) / 100.0
    return lp.float()


def expected_response_lp(prompts, responses, r0):
    out = torch.zeros((len(prompts), r0))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prev = [p[-1], *r[:-1]]
        for j, (tok, before) in enumerate(zip(r, prev)):
            out[i, j] = -(tok + 0.01 * before) / 100.0
    return out


@pytest.mark.parametrize("interleave", [True, False])
def test_groups_adjacent_prompts_byte_identical_and_order_restored(interleave):
    prompts, responses = grpo_rows(0, [4, 7, 5], n=3, interleave=interleave)
    data = legacy_batch(prompts, responses)
    layout = plan_layout(data, response_width=8)
    batch = dense_batch(data, layout, pad_token_id=PAD)
    p = layout.prompt_width
    assert p == 7 and layout.response_width == 8
    assert batch["input_ids"].shape == (9, 15)
    # groups adjacent, prompt columns byte-identical within a group, distinct across groups
    assert group_spans(layout) == [(0, 3), (3, 6), (6, 9)]
    for s, e in group_spans(layout):
        block = batch["input_ids"][s:e, :p]
        assert (block == block[0]).all()
        assert (batch["position_ids"][s:e, :p] == batch["position_ids"][s, :p]).all()
        assert (batch["attention_mask"][s:e, :p] == batch["attention_mask"][s, :p]).all()
    assert len({tuple(batch["input_ids"][s, :p].tolist()) for s, _ in group_spans(layout)}) == 3
    # each server row is the verl row it claims to be: left-padded prompt | right-padded response
    for i, j in enumerate(layout.order.tolist()):
        pr, rs = prompts[j], responses[j]
        assert batch["input_ids"][i, p - len(pr):p].tolist() == pr
        assert batch["input_ids"][i, p:p + len(rs)].tolist() == rs
        assert batch["attention_mask"][i].sum() == len(pr) + len(rs)
        assert batch["position_ids"][i, p - len(pr):p + len(rs)].tolist() == list(range(len(pr) + len(rs)))
        assert torch.equal(batch["prompts"][i], batch["input_ids"][i, :p])
        assert torch.equal(batch["responses"][i], batch["input_ids"][i, p:])
        # RL tensors: zeros over the prompt columns, verl's padded response values after
        assert (batch["old_log_probs"][i, :p] == 0).all()
        assert torch.equal(batch["advantages"][i, p:], data["advantages"][j])
        assert torch.equal(batch["response_mask"][i, p:], data["response_mask"][j])
    assert torch.equal(batch["loss_mask"], batch["response_mask"])
    if interleave:
        assert not torch.equal(layout.order, torch.arange(9))


@pytest.mark.parametrize("interleave", [True, False])
def test_shifted_round_trip_through_verl_no_padding_2_padding(interleave):
    prompts, responses = grpo_rows(1, [3, 6, 5, 2], n=2, interleave=interleave)
    data = legacy_batch(prompts, responses)
    layout = plan_layout(data)
    batch = dense_batch(data, layout, pad_token_id=PAD)
    nested = nested_from_server(fake_shifted(batch), layout, "shifted")
    assert nested.is_nested and torch.equal(nested.offsets(), data["input_ids"].offsets())
    got = no_padding_2_padding(nested, data)
    want = expected_response_lp(prompts, responses, got.shape[1])
    torch.testing.assert_close(got, want)
    # the prompt positions carry the server's prompt log-probs; the last one of every row is 0
    assert (nested.values()[layout.offsets[1:] - 1] == 0).all()


def test_response_aligned_round_trip():
    prompts, responses = grpo_rows(2, [5, 4, 6], n=4, interleave=True)
    data = legacy_batch(prompts, responses)
    layout = plan_layout(data, response_width=8)
    batch = dense_batch(data, layout, pad_token_id=PAD)
    p = layout.prompt_width
    # what the vendor's ZoRRO /forward answers: [B, P+R], column P+j = response token j, zeros before
    response_aligned = torch.zeros(12, p + 8)
    response_aligned[:, p:] = fake_shifted(batch)[:, p - 1 : -1]
    nested = nested_from_server(response_aligned, layout, "response")
    got = no_padding_2_padding(nested, data)
    torch.testing.assert_close(got, expected_response_lp(prompts, responses, got.shape[1]))
    # nothing is invented for prompt positions under response alignment
    first_row = nested.values()[: layout.prompt_lens[0] - 1]
    assert (first_row == 0).all()


def test_v1_nested_fields_round_trip_with_response_from_nested():
    prompts, responses = grpo_rows(3, [4, 2, 6], n=2, interleave=True)
    data = v1_batch(prompts, responses)
    layout = plan_layout(data, response_width=6)
    batch = dense_batch(data, layout, pad_token_id=PAD)
    for i, j in enumerate(layout.order.tolist()):
        r = len(responses[j])
        p = layout.prompt_width
        assert torch.equal(batch["advantages"][i, p:p + r], data["advantages"][j])
        assert (batch["advantages"][i, p + r:] == 0).all()
    nested = nested_from_server(fake_shifted(batch), layout, "shifted")
    per_row = response_from_nested(nested, data["response_mask"])
    want = expected_response_lp(prompts, responses, 6)
    for j, r in enumerate(responses):
        torch.testing.assert_close(per_row[j], want[j, : len(r)])


def test_entropy_and_logprobs_share_one_conversion():
    prompts, responses = grpo_rows(4, [3, 3], n=2, interleave=True)  # two distinct prompts of one length
    data = legacy_batch(prompts, responses)
    layout = plan_layout(data)
    batch = dense_batch(data, layout, pad_token_id=PAD)
    entropy = torch.arange(batch["input_ids"].numel(), dtype=torch.float32).reshape(batch["input_ids"].shape)
    nested = nested_from_server(entropy, layout, "shifted", key="entropy")
    got = no_padding_2_padding(nested, data)
    for j, r in enumerate(responses):
        i = int(layout.inverse[j])
        p = layout.prompt_width
        assert got[j, : len(r)].tolist() == entropy[i, p - 1 : p - 1 + len(r)].tolist()


def test_response_longer_than_wire_width_is_a_config_error():
    prompts, _responses = grpo_rows(5, [3], n=2, interleave=False)
    data = legacy_batch(prompts, [[5] * 8, [6] * 2])
    with pytest.raises(RemoteBackendConfigError) as err:
        plan_layout(data, response_width=4)
    assert err.value.field == "data.max_response_length" and err.value.received == 8


def test_wrong_server_shapes_are_protocol_errors():
    prompts, responses = grpo_rows(6, [3, 4], n=2, interleave=False)
    data = legacy_batch(prompts, responses)
    layout = plan_layout(data, response_width=8)
    with pytest.raises(RemoteProtocolError, match="logprobs"):
        nested_from_server(torch.zeros(4, 5), layout, "shifted")
    with pytest.raises(RemoteProtocolError, match="shifted alignment needs"):
        nested_from_server(torch.zeros(4, 8), layout, "shifted")
    with pytest.raises(RemoteProtocolError, match="response alignment needs"):  # [B, R] is not the vendor's layout
        nested_from_server(torch.zeros(4, 8), layout, "response")
    with pytest.raises(RemoteProtocolError, match="logprob_alignment"):
        nested_from_server(torch.zeros(4, 8), layout, "sideways")


def test_padded_batch_without_nesting_is_rejected_by_name():
    td = tu.get_tensordict({"input_ids": torch.ones(2, 3, dtype=torch.int64)})
    with pytest.raises(RemoteBackendConfigError) as err:
        plan_layout(td)
    assert err.value.field == "data.input_ids"


def test_group_shuffle_keeps_groups_whole_and_split_covers_every_row():
    prompts, responses = grpo_rows(7, [2, 3, 4, 5], n=3, interleave=True)
    layout = plan_layout(legacy_batch(prompts, responses))
    rows = shuffled_rows(layout, seed=11)
    assert sorted(rows.tolist()) == list(range(12)) and not torch.equal(rows, torch.arange(12))
    for chunk in split_rows(rows, 3):  # every chunk of n rows is exactly one group
        assert layout.group_of_server_row[chunk].unique().numel() == 1
    assert torch.equal(shuffled_rows(layout, seed=None), torch.arange(12))
    assert torch.equal(shuffled_rows(layout, seed=11), rows)  # deterministic per seed
