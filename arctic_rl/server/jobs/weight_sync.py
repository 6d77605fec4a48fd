"""A ``/weight-sync``'s work in its worker thread, once the endpoint holds the jobs' locks
(:meth:`arctic_rl.server.jobs.service.ServerState.weight_sync`): the training job's weights loaded into each target,
the training stream settled, then the caching allocator's unused blocks handed back (``--release-at-sync``).

Why the release: in sync mode the sampler's sleep and wake release the allocator's unused blocks every step
(:meth:`arctic_rl.server.engines.device_memory.DeviceMemory.release_unused`), so each step's log-prob and training
passes start from an allocator holding only live tensors. In the asynchronous mode the sampler never sleeps and
nothing released them. On an H100 (benchmarks/RESULTS.md §2zf) the allocator then reserved 29-30 GiB from step 2 on,
against a 20.8 GiB allocated peak -- the same peak as the sync run's, whose reserve stayed at 20.7 -- with the
training stream on or off; by every sign (not traced) step 2's log-prob pass carved its tensors out of the blocks
the update had freed, and the next update mapped new segments beside them. A weight sync ends each step in both modes, so releasing there gives
the async mode sync's per-step release; in sync mode it moves the release the wake did into the sync (the wake then
finds nothing to release). ``off`` keeps the blocks cached (no new segments to map at the next pass).
"""

from __future__ import annotations

from typing import Any

from arctic_rl.server.jobs.registry import Job
from arctic_rl.server.jobs.training_stream import TrainingStream

__all__ = ["load_weights_into"]


def load_weights_into(source: Job, targets: list[Job], training_stream: TrainingStream,
                      release: bool) -> tuple[dict[int, int], dict[str, int]]:
    """Load ``source``'s weights into every target; ``({target job id: its weight version}, released)``, where
    ``released`` holds the allocator's figures of the release (:meth:`DeviceMemory.release_unused`'s fields) when
    ``release``, else is empty."""
    weights = source.engine.weights()
    versions = {t.job_id: t.engine.load_weights(weights) for t in targets}
    del weights
    device: Any = getattr(source.engine, "device", None)
    training_stream.settle(device)  # the loads' copies are done before any job runs again
    if not release:
        return versions, {}
    from arctic_rl.server.engines.device_memory import DeviceMemory

    return versions, DeviceMemory.of(device).release_unused()
