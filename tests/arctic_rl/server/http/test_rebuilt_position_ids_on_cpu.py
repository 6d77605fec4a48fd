"""``position_ids`` the server rebuilds from the attention mask start at 0 on every row.

The vendor's clients leave ``position_ids`` out; the server rebuilds them (``cumsum - 1`` of the
mask). Rotary embeddings depend on position *differences* only, so a shift of every position by
one is invisible in the log-probs that the other tests compare: this test reads the rebuilt ids.
"""

from __future__ import annotations

import torch

from arctic_rl.server.http.validation import parse_batch_body
from tests.support.server import make_batch

PROMPTS = [[5, 6, 7], [8, 9], [4], [3, 2, 1]]
RESPONSES = [[10, 11, 12], [13], [14, 15], [16, 17]]


def _body() -> dict:
    batch = make_batch(PROMPTS, RESPONSES)
    del batch["position_ids"]
    return {"batch": batch, "meta": {"temperature": 1.0}, "processing": {"post": ["apply_temperature"]}}


def test_rebuilt_positions_start_at_zero_on_every_row_and_count_attended_tokens():
    body = _body()
    mask = body["batch"]["attention_mask"]
    parsed = parse_batch_body(body, vocab_size=100, train=False)
    width = mask.shape[1]
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        real = mask[row].nonzero().flatten()
        positions = parsed.position_ids[row, real].tolist()
        assert positions == list(range(len(prompt) + len(response))), (row, positions)
        first = int(real[0])
        assert positions[0] == 0 and int(parsed.position_ids[row, first]) == 0, f"row {row} starts at {positions[0]}"
        assert (parsed.position_ids[row, :first] == 0).all()  # left padding: clamped at 0
    assert parsed.position_ids.shape == (len(PROMPTS), width)


def test_rebuilt_positions_equal_the_ones_a_client_sends():
    body = _body()
    sent = make_batch(PROMPTS, RESPONSES)["position_ids"]
    parsed = parse_batch_body(body, vocab_size=100, train=False)
    real = body["batch"]["attention_mask"] != 0
    assert torch.equal(parsed.position_ids[real], sent[real])
