"""The rollout batching options every backend's ``remote_backend.rollout`` node carries, defined once.

verl's agent loop sends one ``generate`` call per sample; the rollout server
(:mod:`.replica`) gathers concurrent calls into batches
(:mod:`.coalescer`) -- or, against a server that lists ``continuous_batching``, sends
them as they come, the samples of one prompt as one request (:mod:`.sample_groups`:
``max_batch_size`` requests in flight at most, ``max_wait_ms`` the longest a prompt's first sample waits for the
others, ``max_in_flight`` unused). How large a batch may get, how long it waits for more
calls and how many batches may be in flight are :class:`RolloutBatching`: each vendor's config mirror
extends it (its yaml may pick other values, e.g. more batches in flight), and the rollout server reads
it with :meth:`RolloutBatching.from_main_config` -- the one place the fields and range checks live.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from verl.remote_backend.strict_config import build, require, select, to_plain

__all__ = ["ROLLOUT_NODE", "RolloutBatching"]

#: where the options live in verl's main config
ROLLOUT_NODE = "remote_backend.rollout"


@dataclass(frozen=True)
class RolloutBatching:
    """``remote_backend.rollout``'s batching options (a vendor's rollout config extends this class)."""

    #: most generate calls handled together (against a server that batches continuously: most requests in flight)
    max_batch_size: int = 64
    #: milliseconds a batch waits for more calls before it is sent (continuously: a prompt's samples for each other)
    max_wait_ms: float = 5.0
    #: batches in flight at once (not used against a server that batches continuously)
    max_in_flight: int = 1

    def _validate(self, p: str) -> None:
        require(self.max_batch_size >= 1, f"{p}.max_batch_size", "must be positive", ">= 1", self.max_batch_size)
        require(self.max_wait_ms >= 0, f"{p}.max_wait_ms", "negative", ">= 0", self.max_wait_ms)
        require(self.max_in_flight >= 1, f"{p}.max_in_flight", "must be positive", ">= 1", self.max_in_flight)

    @classmethod
    def from_main_config(cls, main_config: Any) -> RolloutBatching:
        """The batching options of ``remote_backend.rollout``, validated (other keys of that node are the
        vendor's). A shipped yaml group sets every key; an absent node or key takes the default above."""
        node = to_plain(select(main_config, ROLLOUT_NODE, None)) or {}
        names = [f.name for f in dataclasses.fields(RolloutBatching)]
        return build(RolloutBatching, {k: node[k] for k in names if k in node}, ROLLOUT_NODE)
