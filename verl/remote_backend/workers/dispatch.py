"""How a rollout server sends verl's one-sample ``generate`` calls to its backend, by the features it lists.

:func:`rollout_dispatcher` picks a :class:`~.sample_groups.SampleGrouper` for a backend that batches continuously
(``continuous_batching``; a prompt's samples as one request where ``n_samples`` is listed too) and a
:class:`~.coalescer.RequestCoalescer` (bounded batches, one row per sample) for any other, such as the vendor's
Arctic RL server. :func:`backend_features` reads the names a backend lists.
"""

from __future__ import annotations

from verl.remote_backend.logs import module_logger
from verl.remote_backend.workers.batching import RolloutBatching
from verl.remote_backend.workers.coalescer import BatchFn, RequestCoalescer
from verl.remote_backend.workers.sample_groups import GroupFn, SampleGrouper

__all__ = ["CONTINUOUS_BATCHING", "N_SAMPLES", "backend_features", "rollout_dispatcher"]

logger = module_logger(__name__)

#: feature names (a backend's ``features``, the server's ``/health`` list) the rollout server acts on
CONTINUOUS_BATCHING = "continuous_batching"
N_SAMPLES = "n_samples"


def backend_features(backend: object) -> frozenset[str]:
    """The capability names a backend's ``features`` attribute lists (the server's ``/health`` features for the
    Arctic adapter); none when it has no such attribute."""
    features = getattr(backend, "features", None)
    if callable(features):
        features = features()
    try:
        return frozenset(str(f) for f in features or ())
    except TypeError:
        return frozenset()


def rollout_dispatcher(backend: object, batching: RolloutBatching, *, samples_per_prompt: int,
                       run_batch: BatchFn, run_group: GroupFn, deterministic: bool = False
                       ) -> RequestCoalescer | SampleGrouper:
    """How the rollout server sends verl's one-sample calls to ``backend`` (see the module docstring): a
    :class:`SampleGrouper` (``run_group``: one prompt, ``n`` samples) when the backend lists
    ``continuous_batching``, else a :class:`RequestCoalescer` (``run_batch``: many prompts, one sample each).

    ``deterministic`` (verl's ``rollout.full_determinism``): one request per sample even where ``n`` is taken --
    which samples of a prompt share a request would depend on when they arrive, and with it the seeds a backend
    derives per request."""
    features = backend_features(backend)
    if CONTINUOUS_BATCHING in features:
        use_n = N_SAMPLES in features and not deterministic
        logger.info("rollout server: the sampler batches continuously; calls go as they come, %s",
                    f"the {samples_per_prompt} samples of a prompt as one request" if use_n else "one per sample")
        return SampleGrouper(run_group, group_size=samples_per_prompt, max_wait_ms=batching.max_wait_ms,
                             max_in_flight=batching.max_batch_size, use_n=use_n)
    return RequestCoalescer(run_batch, max_batch_size=batching.max_batch_size, max_wait_ms=batching.max_wait_ms,
                            max_in_flight=batching.max_in_flight)
