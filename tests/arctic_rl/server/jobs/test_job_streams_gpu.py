"""``--job-streams on`` on a GPU: a job's call runs on its own non-default stream, and its writes are complete when
the call returns, for a reader on another thread and stream (``jobs/job_streams.py``).

The streams are non-blocking: without the wait at the end of a call, a reader on the default stream could see the
tensor before the job's queued kernels wrote it. Skipped without a CUDA device (run on a GPU box:
``python -m pytest tests/arctic_rl/server/jobs/test_job_streams_gpu.py``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from arctic_rl.protocol import JobType
from arctic_rl.server.jobs.job_streams import JobStreams

pytestmark = pytest.mark.gpu


def _slow_write(out: torch.Tensor, seen: dict) -> None:
    """Queue enough matmuls that they are still running when the Python call returns, then write ``out``."""
    seen["stream"] = torch.cuda.current_stream()
    x = torch.full((2048, 2048), 1.0 / 2048, device=out.device)
    for _ in range(200):
        x = x @ x.T.contiguous() * 1.0 + 0.0  # stays all 1/2048: each row sums 2048 entries of (1/2048)^2
    out.copy_(x[0, :16] * 2048)  # ones


def test_a_call_runs_on_its_jobs_stream_and_its_writes_are_done_when_it_returns():
    device = torch.device("cuda")
    streams = JobStreams("on")
    out = torch.zeros(16, device=device)
    seen: dict = {}
    streams.call(1, JobType.TRAINING, device, _slow_write, out, seen)
    stream = streams.stream_of(1)
    assert stream is not None and seen["stream"] == stream
    assert stream != torch.cuda.default_stream(device)
    read: dict = {}

    def reader() -> None:  # another thread, the default stream, no wait of its own before the copy
        read["values"] = out.to("cpu", non_blocking=False)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join()
    assert torch.allclose(read["values"], torch.ones(16)), read["values"]


def test_jobs_get_their_own_streams_samplers_none_and_a_dropped_job_a_new_one():
    device = torch.device("cuda")
    streams = JobStreams("on")
    current: dict = {}
    for job_id, job_type in ((1, JobType.TRAINING), (2, JobType.LOG_PROB), (3, JobType.SAMPLING)):
        streams.call(job_id, job_type, device, lambda j=job_id: current.__setitem__(j, torch.cuda.current_stream()))
    default = torch.cuda.default_stream(device)
    assert current[1] != current[2] and default not in (current[1], current[2])
    assert current[3] == default and streams.stream_of(3) is None
    first = streams.stream_of(1)
    streams.drop(1)
    assert streams.stream_of(1) is None
    streams.call(1, JobType.TRAINING, device, lambda: None)
    assert streams.stream_of(1) is not None and streams.stream_of(1) is not first
    streams.settle(device)  # waits for the device; nothing queued is left after it
    assert torch.cuda.current_stream(device).query()
