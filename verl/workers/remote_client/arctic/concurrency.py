"""Whether an Arctic RL server can run verl's asynchronous mode, and what its weight sync promises.

Two questions the asynchronous remote mode (``verl/remote_backend/async_trainer.py``) asks a backend:

* :func:`jobs_run_concurrently` -- is a ``/generate`` of the sampling job answered while a call of the training
  job computes? ``remote_backend.server.concurrent_jobs`` (``true``/``false``) answers for the user; left at
  ``null`` the server does:

  - a server that lists features in ``/health`` (the reference server) answers with the ``concurrent_jobs``
    feature, and one that lists features without it cannot;
  - a server that lists none is the vendor's (Arctic-Platform, v2 and v1 alike answer ``{"status": "OK"}``).
    Its routes are ``async`` and *await* their workers -- ``/forward-backward`` and ``/step`` the training
    job's DeepSpeed workers (Ray actors), ``/generate`` the sampling job's replica pool (v2:
    ``common/http_server.py``, v1: ``rl/http_server.py``) -- and the jobs are placed on workers of their own
    (``--training-gpus``, ``--sampling-gpus``), so one route does not hold the other.
* :func:`answers_stay_whole` -- does every ``/generate`` answer come from one weight version when a weight sync
  lands while it generates? The reference server promises it with ``concurrent_jobs`` (its weight load waits
  for the calls in flight, or runs them again on the new weights: ``--in-flight-on-weight-load``). The vendor's
  server promises nothing about it, so verl's side holds new calls and waits for those in flight around each
  weight sync (:mod:`verl.remote_backend.workers.weight_fence`).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from arctic_rl.protocol import Features
from verl.remote_backend.async_trainer import concurrency_listed

__all__ = ["CONCURRENT_JOBS_KEY", "answers_stay_whole", "jobs_run_concurrently"]

#: the user's answer to :func:`jobs_run_concurrently` (null: ask the server)
CONCURRENT_JOBS_KEY = "remote_backend.server.concurrent_jobs"


def jobs_run_concurrently(features: AbstractSet[str], setting: bool | None) -> tuple[bool, str]:
    """``(yes, why)``: whether the server answers ``/generate`` while its training job computes."""
    if setting is not None:
        return bool(setting), f"{CONCURRENT_JOBS_KEY}={str(bool(setting)).lower()}"
    if features:  # the reference server, or another that lists what it can
        return concurrency_listed(features)
    return True, ("the server lists no features (the vendor's Arctic RL server): its routes await the training job's "
                  "workers and the sampling job's replica pool, which are separate")


def answers_stay_whole(features: AbstractSet[str]) -> tuple[bool, str]:
    """``(yes, why)``: whether each ``/generate`` answer is sampled with one weight version across a weight sync."""
    if Features.CONCURRENT_JOBS in features:
        return True, ("the server lists 'concurrent_jobs': its weight sync waits for the calls in flight or runs "
                      "them again on the new weights")
    return False, "the server does not promise that a weight sync leaves the /generate calls in flight alone"
