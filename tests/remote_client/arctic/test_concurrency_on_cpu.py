"""Whether an Arctic RL server runs verl's asynchronous mode, and whether its weight sync needs the fence
(``verl/workers/remote_client/arctic/concurrency.py``), through the generic questions the async trainer asks
(:func:`~verl.remote_backend.async_trainer.concurrency_of`, :func:`~verl.remote_backend.async_trainer.keeps_answers_whole`).

The whole runs: tests/special_e2e/test_grpo_async.py (the reference server) and
tests/conformance/test_vendor_async_on_cpu.py (the vendor's server, fenced; and ``concurrent_jobs=false``).
"""

from __future__ import annotations

import pytest

from arctic_rl.protocol import Features
from verl.remote_backend.async_trainer import concurrency_of, keeps_answers_whole
from verl.workers.remote_client.arctic.concurrency import answers_stay_whole, jobs_run_concurrently

REFERENCE = frozenset({Features.CONTINUOUS_BATCHING, Features.CONCURRENT_JOBS, Features.SAMPLER_SLEEP})
WITHOUT = frozenset({Features.CONTINUOUS_BATCHING, Features.SAMPLER_SLEEP})
VENDOR = frozenset()  # the vendor's /health: {"status": "OK"}


@pytest.mark.parametrize("features, setting, expected, says", [
    (REFERENCE, None, True, "lists 'concurrent_jobs'"),
    (WITHOUT, None, False, "does not list the 'concurrent_jobs' feature (it lists: continuous_batching, sampler_sleep)"),
    (VENDOR, None, True, "the vendor's Arctic RL server"),
    (VENDOR, False, False, "remote_backend.server.concurrent_jobs=false"),
    (REFERENCE, False, False, "remote_backend.server.concurrent_jobs=false"),
    (WITHOUT, True, True, "remote_backend.server.concurrent_jobs=true"),
])
def test_who_answers_whether_the_jobs_run_at_once(features, setting, expected, says):
    ok, why = jobs_run_concurrently(features, setting)
    assert ok is expected and says in why


def test_only_a_server_listing_concurrent_jobs_keeps_answers_whole():
    assert answers_stay_whole(REFERENCE)[0] is True
    for features in (WITHOUT, VENDOR):
        ok, why = answers_stay_whole(features)
        assert ok is False and "does not promise" in why


class _Client:
    """The two methods the adapter's client defines, over a feature set (as ArcticRLClient's)."""

    def __init__(self, features, setting=None):
        self.features, self.setting = features, setting

    def concurrent_jobs(self):
        return jobs_run_concurrently(self.features, self.setting)

    def weight_sync_keeps_answers_whole(self):
        return answers_stay_whole(self.features)


def test_the_async_trainer_reads_the_methods_before_the_features():
    # a method wins over the features set: the vendor (no features) runs asynchronously, fenced
    assert concurrency_of(_Client(VENDOR))[0] is True
    assert keeps_answers_whole(_Client(VENDOR))[0] is False
    assert concurrency_of(_Client(REFERENCE, setting=False))[0] is False
    # a backend that does not say whether its answers stay whole is fenced
    ok, why = keeps_answers_whole(object())
    assert ok is False and "does not say" in why
