"""The training and log_prob jobs' calls on a CUDA stream apart from the sampler's (``--training-stream on``; off by
default).

In the asynchronous mode (docs/ASYNC.md) the sampler generates the next batch while the training side's
``/forward``, ``/forward-backward`` and ``/step`` run in the same process. Without this every kernel of every job
goes to the device's default stream, which the sampler's engine loop uses as well: the two sides' kernels queue
behind each other, a pass that waits for its results waits for the sampler's queued work too, and PyTorch's caching
allocator, which keeps free blocks per stream, hands the sampler's allocations the large blocks a training pass has
just freed (benchmarks/RESULTS.md §2ze: in async mode the reserve grew ~6 GiB over the allocated peak, against none
in sync mode, where the sampler's sleep releases it).

With ``on``, where the jobs compute on CUDA:

* the training and log_prob jobs share one stream (made at the first call; they never compute at once in a GRPO
  step, and one stream keeps one set of free blocks for both, as the default stream did). Every call of such a job
  (its batch's parse, its pass, its answer) runs with that stream current in its worker thread and waits for the
  stream before it answers: what a call wrote -- the weights after ``/step``, its results -- is complete when any
  other job or thread reads it. A job's first call first waits for the whole device, so that its building and
  warm-up, queued on the default stream, are done;
* a weight sync waits for the whole device before it releases the jobs it holds (:meth:`TrainingStream.settle`):
  the sampler's load is queued by its engine loop and a log_prob job's load by a worker thread, each on its own
  thread's stream, and neither the source's next ``/step`` nor the target's next pass may overtake those copies.

Samplers are left as they are (their engine loop owns its thread). On CPU, or with ``off``, calls run as before: no
stream, no waits. The stream is one of PyTorch's non-blocking ones, so the default stream's work never orders it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from arctic_rl.protocol import JobType
from arctic_rl.server.settings import TRAINING_STREAM_MODES

__all__ = ["TrainingStream"]

#: the job types whose calls run on the training stream (a sampler's engine loop keeps its own thread and stream)
STREAM_JOB_TYPES = (JobType.TRAINING, JobType.LOG_PROB)

T = TypeVar("T")


def _cuda_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` when it names a CUDA device, else None (torch imported only then)."""
    if device is None or "cuda" not in str(device):
        return None
    import torch

    return torch.device(device)


class TrainingStream:
    """The training side's CUDA stream: :meth:`call` runs a job's call on it, :meth:`settle` follows a weight sync,
    :meth:`drop` forgets a destroyed job."""

    def __init__(self, mode: str) -> None:
        if mode not in TRAINING_STREAM_MODES:
            raise ValueError(f"training_stream: expected one of {list(TRAINING_STREAM_MODES)}, got {mode!r}")
        self.enabled = mode == "on"
        self._stream: Any | None = None
        self._started: set[int] = set()  # the jobs whose first call has waited for the device
        self._lock = threading.Lock()

    @property
    def stream(self) -> Any | None:
        """The stream the training side's calls run on, or None (no call yet, off, CPU)."""
        return self._stream

    def _stream_for(self, job_id: int, job_type: JobType, device: Any) -> Any | None:
        if not self.enabled or job_type not in STREAM_JOB_TYPES:
            return None
        cuda = _cuda_device(device)
        if cuda is None:
            return None
        import torch

        with self._lock:
            if job_id not in self._started:
                torch.cuda.synchronize(cuda)  # the job's building and warm-up, queued on the default stream
                self._started.add(job_id)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=cuda)
            return self._stream

    def call(self, job_id: int, job_type: JobType, device: Any, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` with the training stream current in this thread, the stream waited for before returning (or
        raising); a plain call where the job gets no stream."""
        stream = self._stream_for(job_id, job_type, device)
        if stream is None:
            return fn(*args)
        import torch

        with torch.cuda.stream(stream):
            try:
                return fn(*args)
            finally:
                stream.synchronize()

    def settle(self, device: Any) -> None:
        """After a weight sync, before its jobs are released: wait for the device (no-op when off or not CUDA)."""
        cuda = _cuda_device(device) if self.enabled else None
        if cuda is not None:
            import torch

            torch.cuda.synchronize(cuda)

    def drop(self, job_id: int) -> None:
        """Forget a destroyed job (its calls all waited for the stream)."""
        with self._lock:
            self._started.discard(job_id)
