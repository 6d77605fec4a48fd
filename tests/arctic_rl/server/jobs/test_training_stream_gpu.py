"""``--training-stream on`` on a GPU: a training or log_prob job's call runs on the training stream, not the default
one, and its writes are complete when the call returns, for a reader on another thread and stream
(``jobs/training_stream.py``).

The stream is non-blocking: without the wait at the end of a call, a reader on the default stream could see the
tensor before the job's queued kernels wrote it. Skipped without a CUDA device (run on a GPU box:
``python -m pytest tests/arctic_rl/server/jobs/test_training_stream_gpu.py``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from arctic_rl.protocol import JobType
from arctic_rl.server.jobs.training_stream import TrainingStream

pytestmark = pytest.mark.gpu


def _slow_write(out: torch.Tensor, seen: dict) -> None:
    """Queue enough matmuls that they are still running when the Python call returns, then write ``out``."""
    seen["stream"] = torch.cuda.current_stream()
    x = torch.full((2048, 2048), 1.0 / 2048, device=out.device)
    for _ in range(200):
        x = x @ x.T.contiguous()  # stays all 1/2048: each entry sums 2048 products of (1/2048)^2
    out.copy_(x[0, :16] * 2048)  # ones


def test_a_call_runs_on_the_training_stream_and_its_writes_are_done_when_it_returns():
    device = torch.device("cuda")
    training = TrainingStream("on")
    out = torch.zeros(16, device=device)
    seen: dict = {}
    training.call(1, JobType.TRAINING, device, _slow_write, out, seen)
    assert training.stream is not None and seen["stream"] == training.stream
    assert training.stream != torch.cuda.default_stream(device)
    read: dict = {}

    def reader() -> None:  # another thread, the default stream, no wait of its own before the copy
        read["values"] = out.to("cpu")

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join()
    assert torch.allclose(read["values"], torch.ones(16)), read["values"]


def test_training_and_log_prob_share_the_stream_and_a_sampler_stays_on_the_default():
    device = torch.device("cuda")
    training = TrainingStream("on")
    current: dict = {}
    for job_id, job_type in ((1, JobType.TRAINING), (2, JobType.LOG_PROB), (3, JobType.SAMPLING)):
        training.call(job_id, job_type, device, lambda j=job_id: current.__setitem__(j, torch.cuda.current_stream()))
    default = torch.cuda.default_stream(device)
    assert current[1] == current[2] == training.stream and current[1] != default
    assert current[3] == default
    training.drop(1)
    training.call(4, JobType.TRAINING, device, lambda: None)  # a new job: the same stream, after a device wait
    assert training.stream == current[1]
    training.settle(device)
    assert training.stream.query() and torch.cuda.default_stream(device).query()
