"""When to take a recovery checkpoint: the base a restore starts from.

Every ``recovery.checkpoint_every_n_steps`` optimizer steps -- or early, when the update journal
overflowed (:mod:`.journal`) -- the training client saves a checkpoint through its own
``save_checkpoint``, which resets the journal to it; a restore then loads it and replays only what
follows. The directory is ``recovery.checkpoint_path``, else ``<the training job's checkpoint
path>/recovery``.

What is not here: the save itself (:mod:`.checkpoints`), the restore (:mod:`.restore`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from .arctic_config import RecoveryConfig
from .journal import UpdateJournal

__all__ = ["CheckpointSchedule"]

logger = logging.getLogger(__name__)


class CheckpointSchedule:
    """Recovery checkpoints of one training client. ``job_info()`` is ``GET /job/{training}`` (it may
    name the job's checkpoint directory); ``default_path`` the configured ``train.checkpoint_path``."""

    def __init__(self, config: RecoveryConfig, journal: UpdateJournal, stats: Counter[str], *,
                 job_info: Callable[[], dict], default_path: str | None) -> None:
        self.config = config
        self.journal = journal
        self.stats = stats
        self._job_info = job_info
        self._default_path = default_path
        self._dir: str | None = config.checkpoint_path

    def after_step(self, step: int, save: Callable[..., dict]) -> None:
        """After optimizer step ``step``: save a recovery checkpoint when due. ``save`` is the client's
        ``save_checkpoint(step=, path=, save_total_limit=)``."""
        cfg = self.config
        due = cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0
        if not cfg.enable or not (due or self.journal.overflowed):
            return
        if self._dir is None:
            base = self._job_info().get("checkpoint_path") or self._default_path
            if not base:
                logger.error("arctic: no directory for recovery checkpoints (set remote_backend.recovery."
                             "checkpoint_path); a restart will replay the journal from the start of the run")
                return
            self._dir = f"{str(base).rstrip('/')}/recovery"
        out = save(step=step, path=self._dir, save_total_limit=cfg.checkpoint_keep)
        self.stats["checkpoints_saved"] += 1
        logger.info("arctic: recovery checkpoint of step %d at %s", step, out.get("path"))
