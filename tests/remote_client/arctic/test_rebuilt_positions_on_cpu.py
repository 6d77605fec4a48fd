"""``position_ids`` the adapter rebuilds for a batch that carries none start at 0 on every row.

verl sends nested ``position_ids``; a batch without them gets them from the layout
(:func:`verl.workers.remote_client.arctic.layout.dense_batch`). Rotary embeddings see position
differences only, so a row shifted by its padding would pass every log-prob comparison: this test
reads the positions themselves, on rows of different padding.
"""

from __future__ import annotations

from tests.support.arctic import PAD, v1_batch
from verl.workers.remote_client.arctic.layout import dense_batch, plan_layout

PROMPTS = [[5, 6, 7], [8, 9], [4], [3, 2, 1, 9]]
RESPONSES = [[10, 11, 12], [13], [14, 15], [16, 17]]


def test_positions_rebuilt_from_the_layout_start_at_zero_on_every_row():
    data = v1_batch(PROMPTS, RESPONSES)
    given = dense_batch(data, plan_layout(data, response_width=None, group_rows=False), pad_token_id=PAD)
    del data["position_ids"]
    layout = plan_layout(data, response_width=None, group_rows=False)
    batch = dense_batch(data, layout, pad_token_id=PAD)
    mask = batch["attention_mask"]
    for i, j in enumerate(layout.order.tolist()):
        real = mask[i].nonzero().flatten()
        positions = batch["position_ids"][i, real].tolist()
        assert positions == list(range(len(PROMPTS[j]) + len(RESPONSES[j]))), (j, positions)
        assert (batch["position_ids"][i, mask[i] == 0] == 0).all()  # padding: 0
    assert (batch["position_ids"] == given["position_ids"]).all()  # what verl would have sent
