"""Where a :class:`~verl.workers.remote_client.arctic.request.JobRequest` goes, addressed from the run's state.

A request names its job as data -- ``?job_id=``, the id in the path (``GET /job/{id}``) or the weight sync's
targets -- and is addressed afresh at every send: after a restore publishes new job ids, the same request
object reaches the new jobs. No server: :meth:`JobRequest.target` is pure.
"""

from __future__ import annotations

import pytest

from arctic_rl.protocol import JobType, Paths
from verl.workers.remote_client.arctic.dialect import Payload, dialect_for
from verl.workers.remote_client.arctic.request import JobRequest, WeightSync
from verl.workers.remote_client.arctic.state import RunState


def _state(version: int = 2, **job_ids: int) -> RunState:
    return RunState(http=None, dialect=dialect_for(version), features=frozenset(), job_ids=dict(job_ids), owned={},
                    instance_id=None, client_tag=None)


def test_a_job_call_carries_the_current_job_id_in_the_query():
    state = _state(training=3)
    request = JobRequest("POST", Paths.STEP, op="step", idempotent=False, job=JobType.TRAINING,
                         payload=Payload(json={"a": 1}))
    assert request.target(state) == (Paths.STEP, {"job_id": 3}, Payload(json={"a": 1}))
    state.publish_jobs({"training": 7}, None, created={})
    assert request.target(state)[1] == {"job_id": 7}  # a restore's new job, same request object
    assert request.target(state, job_id=9)[1] == {"job_id": 9}  # the restore's own calls to an unpublished job


def test_job_info_puts_the_id_in_the_path():
    request = JobRequest.job_info(JobType.LOG_PROB)
    assert request.what == f"GET {Paths.JOB}" and request.idempotent
    assert request.target(_state(log_prob=5))[:2] == (Paths.job(5), None)


@pytest.mark.parametrize("to_log_prob", [False, True])
def test_the_weight_sync_names_the_current_jobs(to_log_prob):
    request = JobRequest("POST", "weight sync", op="weight_sync", idempotent=True,
                         weight_sync=WeightSync(to_log_prob=to_log_prob, cuda_ipc=False, low_memory=True))
    state = _state(sampling=1, log_prob=2, training=3)
    route = state.dialect.weight_sync(training=3, sampling=1, log_prob=2 if to_log_prob else None, cuda_ipc=False,
                                      low_memory=True)
    assert request.target(state) == (route.path, route.params, Payload(json=route.body))
    assert route.body["target_sub_job_ids"] == ([1, 2] if to_log_prob else [1])
    state.publish_jobs({"sampling": 11, "log_prob": 12, "training": 13}, None, created={})
    assert request.target(state)[1] == {"job_id": 13}
