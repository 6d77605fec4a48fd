"""What the server asks of an engine: one :class:`typing.Protocol` per job type.

The HTTP layer (:mod:`arctic_rl.server.jobs.service`, :mod:`arctic_rl.server.http.control`) reaches an
engine only through these; the classes of :mod:`arctic_rl.server.engines` satisfy them structurally:

==========================  ==============================================================================
protocol                    satisfied by
==========================  ==============================================================================
:class:`TrainingEngine`     :class:`~arctic_rl.server.engines.training.TrainingEngine`
:class:`LogProbEngine`      :class:`~arctic_rl.server.engines.logprob_engine.LogProbEngine`
:class:`SamplingEngine`     :class:`~arctic_rl.server.engines.sampling.SamplingEngine`,
                            :class:`~arctic_rl.server.engines.vllm_sampler.VllmSamplingEngine`
==========================  ==============================================================================

Every engine has a device, a job config, ``info()`` (its part of ``GET /job/{id}``), ``memory_report()`` and
``close()`` (free what it holds; the server calls it once, on ``/destroy`` or at shutdown). :data:`Engine` is any of the three.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from arctic_rl.protocol import GenerateRequest, JobConfig, LogprobAlignment, SamplingParams

if TYPE_CHECKING:
    from arctic_rl.server.engines.batch import ParsedBatch
    from arctic_rl.server.engines.continuous import Pending

__all__ = ["BaseEngine", "Engine", "LogProbEngine", "SamplingEngine", "TrainingEngine"]

#: ``/forward``'s answer: the tensors by name, the call's metrics, and the layout of the log-probs
ForwardResult = tuple[dict[str, torch.Tensor], dict[str, float], LogprobAlignment]


class BaseEngine(Protocol):
    """What every engine has."""

    config: JobConfig
    device: torch.device

    def info(self) -> dict[str, Any]:
        """The engine's part of ``GET /job/{id}`` (weight version, memory, ...)."""
        ...

    def close(self) -> None:
        """Free the model and what else the engine holds; the engine is not used afterwards."""
        ...

    def memory_report(self) -> dict[str, int]:
        """The job's memory by part, in bytes (:mod:`arctic_rl.server.memory`)."""
        ...


class TrainingEngine(BaseEngine, Protocol):
    """A ``training`` job: fwd/bwd, optimizer steps, checkpoints, the weights a weight sync sends."""

    vocab_size: int

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def global_step(self) -> int: ...

    def forward_backward(self, batch: ParsedBatch) -> dict[str, Any]: ...

    def step(self, learning_rate: float | None = None) -> dict[str, Any]: ...

    def forward(self, batch: ParsedBatch) -> ForwardResult: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def save(self, ckpt: Path, *, export_hf: bool) -> dict[str, Any]: ...

    def load(self, ckpt: Path) -> dict[str, Any]: ...


class LogProbEngine(BaseEngine, Protocol):
    """A ``log_prob`` job: no-grad log-probs of batches and of raw texts; takes weight syncs."""

    vocab_size: int
    weight_version: int

    def forward(self, batch: ParsedBatch) -> ForwardResult: ...

    def text_logprobs(self, texts: list[str]) -> torch.Tensor: ...

    def load_weights(self, weights: dict[str, torch.Tensor]) -> int: ...


class SamplingEngine(BaseEngine, Protocol):
    """A ``sampling`` job: ``/generate`` (batched continuously), weight syncs, sleep and wake."""

    weight_version: int

    def submit_generate(self, request: GenerateRequest, params: SamplingParams) -> Pending: ...

    def generate(self, request: GenerateRequest, params: SamplingParams) -> list[dict[str, Any]]: ...

    def load_weights(self, weights: dict[str, torch.Tensor]) -> int: ...

    def sleep(self, level: int = 1) -> dict[str, Any]: ...

    @property
    def awake(self) -> bool: ...

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]: ...

    def reset_prefix_cache(self) -> dict[str, Any]: ...

    def weight_norm(self) -> dict[str, Any]: ...


#: the engine of a job, whichever its type
Engine: TypeAlias = TrainingEngine | LogProbEngine | SamplingEngine
