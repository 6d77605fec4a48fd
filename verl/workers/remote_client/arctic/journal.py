"""The update journal: the training-job mutations acknowledged since the last good checkpoint.

After a server restart, :class:`~.recovery.Recovery` loads :attr:`UpdateJournal.base` (``None``: a
freshly created job, valid only from step 0) and replays :attr:`UpdateJournal.entries` -- every
``/forward-backward`` body (the encoded DSSST1 frame, kept without a copy) and every ``/step``, in
order -- which puts the training job exactly where it was when the last of them was answered.

The journal is bounded (``recovery.journal_max_mb``). When it overflows it is dropped with an
ERROR (once per client; later overflows log at INFO), :attr:`UpdateJournal.complete` turns false,
and the next step boundary checkpoints early; a restart before that restores the checkpoint only.
What is not here: deciding when to record or replay (:mod:`.recovery`, :mod:`.arctic_rl`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointRef", "JournalEntry", "UpdateJournal"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint of the training job on the server: its directory and global step."""

    path: str
    step: int


@dataclass(frozen=True)
class JournalEntry:
    """One acknowledged training-job mutation: POST ``path`` with ``body`` (bytes or JSON)."""

    path: str
    body: Any
    content_type: str | None
    is_step: bool
    nbytes: int


@dataclass
class UpdateJournal:
    """The training-job mutations acknowledged since :attr:`base` (``None``: a freshly created job)."""

    max_bytes: int
    base: CheckpointRef | None = None
    entries: list[JournalEntry] = field(default_factory=list)
    nbytes: int = 0
    overflowed: bool = False
    dropped_steps: int = 0
    overflows: int = 0
    #: the base and entries a *save* replaced, kept until the next weight sync (:meth:`drop_previous`): a restore
    #: rebuilds from them the older step whose weights the sampler still has (:mod:`.restore`). Outside the bound:
    #: at most one checkpoint interval's entries more.
    previous: tuple[CheckpointRef | None, list[JournalEntry]] | None = None

    @property
    def complete(self) -> bool:
        """Whether replaying :attr:`entries` on :attr:`base` reproduces the current state."""
        return not self.overflowed

    @property
    def steps(self) -> int:
        return sum(e.is_step for e in self.entries) + self.dropped_steps

    def reset(self, base: CheckpointRef | None, *, keep_previous: bool = False) -> None:
        """Start over from ``base``; ``keep_previous`` (a save: the training state did not change) keeps what led
        here as :attr:`previous`, when it is complete -- appended to a part still kept (two saves with no weight
        sync between them, e.g. a recovery checkpoint and verl's own at one step), so it starts where that did."""
        if not (keep_previous and self.complete):
            self.previous = None
        elif self.previous is not None:
            self.previous = (self.previous[0], self.previous[1] + self.entries)
        else:
            self.previous = (self.base, self.entries)
        self.base, self.entries, self.nbytes, self.overflowed, self.dropped_steps = base, [], 0, False, 0

    def drop_previous(self) -> None:
        """The sampler has weights of a step at or after :attr:`base`: :attr:`previous` is no longer needed."""
        self.previous = None

    def start_unknown(self, step: int) -> None:
        """A client that joins a run at ``step > 0`` does not know what preceded it: incomplete until
        its first checkpoint (which the next step boundary takes)."""
        self.reset(None)
        self.overflowed = True
        logger.info("arctic: attached at step %d: a restart before this client's first checkpoint cannot be "
                    "restored by it (a checkpoint is taken at the next step boundary)", step)

    def record(self, path: str, body: Any, content_type: str | None, *, is_step: bool) -> None:
        if self.overflowed:
            self.dropped_steps += int(is_step)
            return
        size = len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 64
        if self.nbytes + size > self.max_bytes:
            self.overflowed = True
            self.overflows += 1
            self.dropped_steps = sum(e.is_step for e in self.entries) + int(is_step)
            logger.log(logging.ERROR if self.overflows == 1 else logging.INFO,
                "arctic: the update journal is full (%d + %d bytes > recovery.journal_max_mb = %.1f MiB): it is "
                "dropped. A server restart before the next checkpoint (taken early, at the next step boundary) "
                "restores that checkpoint only and LOSES the steps since it. Raise recovery.journal_max_mb or "
                "lower recovery.checkpoint_every_n_steps.", self.nbytes, size, self.max_bytes / 2**20)
            self.entries, self.nbytes = [], 0
            return
        self.entries.append(JournalEntry(path, body, content_type, is_step, size))
        self.nbytes += size
