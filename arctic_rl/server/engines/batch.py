"""The batch an engine computes on: a ``/forward`` or ``/forward-backward`` body once validated.

:func:`arctic_rl.server.http.validation.parse_batch_body` builds it; the engines read it. It holds the
``[B, P+R]`` model inputs as int64 and the RL tensors response-sliced to ``[B, R]``, and answers the
questions every engine asks of a call: does it want the entropy, at which temperature are its log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arctic_rl.protocol import BatchMeta, LossConfig, Processing

__all__ = ["ParsedBatch"]

_ENTROPY_POSTS = ("compute_entropy", "compute_entropy_and_logprobs")


@dataclass
class ParsedBatch:
    """A validated body. ``rl`` holds response-sliced ``[B, R]`` tensors (masks as bool)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_len: int
    meta: BatchMeta
    meta_keys: frozenset[str]
    processing: Processing
    loss_name: str | None = None
    loss_config: LossConfig | None = None
    rl: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def total_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def response_len(self) -> int:
        return self.total_len - self.prompt_len

    @property
    def wants_entropy(self) -> bool:
        """Whether the caller wants the entropy computed (it costs a full pass over the logits).

        A body whose ``meta`` says ``calculate_entropy`` decides by it (``compute_entropy_and_logprobs``
        then means the log-probs, with the entropy only if asked: clients send that post-processor on
        every call). Without the key, the post-processor names decide, as on the vendor's server.
        """
        posts = self.processing.post
        posts = [posts] if isinstance(posts, str) else list(posts or [])
        if "calculate_entropy" in self.meta_keys:
            return bool(self.meta.calculate_entropy) or "compute_entropy" in posts
        return any(p in _ENTROPY_POSTS for p in posts)

    @property
    def applies_temperature(self) -> bool:
        """Whether ``processing.post`` names ``apply_temperature`` (the vendor's only way to scale logits)."""
        posts = self.processing.post
        return "apply_temperature" in ([posts] if isinstance(posts, str) else list(posts or []))

    def scoring_temperature(self, zorro_job_temperature: float | None = None) -> float:
        """The temperature the log-probs of this body are computed at, the vendor's way.

        ZoRRO jobs with ``ds_worker_config.temperature`` use it on every call (the vendor builds its
        ZoRRO patch with it); otherwise ``meta.temperature`` applies only when ``processing.post``
        names ``apply_temperature``, and the distribution is unscaled (1.0) when it does not.
        """
        if zorro_job_temperature is not None:
            return float(zorro_job_temperature)
        return float(self.meta.temperature) if self.applies_temperature else 1.0

    def slice_rows(self, start: int, stop: int) -> ParsedBatch:
        """Rows ``start:stop`` (for chunked no-grad forwards)."""
        return ParsedBatch(
            self.input_ids[start:stop],
            self.attention_mask[start:stop],
            self.position_ids[start:stop],
            self.prompt_len,
            self.meta,
            self.meta_keys,
            self.processing,
            self.loss_name,
            self.loss_config,
            {k: v[start:stop] for k, v in self.rl.items()},
        )
