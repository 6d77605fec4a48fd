"""The reference server's engines, one class per job type.

==============  ============================================  =====================================
job type        class                                         does
==============  ============================================  =====================================
``training``    :class:`~.training.TrainingEngine`            DeepSpeed fwd/bwd, step, checkpoints
``log_prob``    :class:`~.logprob_engine.LogProbEngine`       no-grad log-probs (reference policy)
``sampling``    :class:`~.sampling.SamplingEngine`            generation with ``transformers``
``sampling``    :class:`~.vllm_sampler.VllmSamplingEngine`    generation with vLLM (``--sampler``)
==============  ============================================  =====================================

Engines are synchronous and not thread-safe; the server calls each from a worker thread under
the job's lock -- except ``/generate`` on the samplers, which batch continuously: their
``submit_generate`` queues a call into a running batch that one loop thread owns
(:mod:`.continuous`), and their weight loads, sleep and wake run on that thread between calls. Modules are imported lazily so that ``import arctic_rl.server.app`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.settings import ServerSettings

if TYPE_CHECKING:
    from arctic_rl.server.engines.protocols import Engine

__all__ = ["create_engine"]


def create_engine(config: JobConfig, settings: ServerSettings, job_dir: Path | None) -> Engine:
    """Build the engine of ``config.job_type`` (slow: loads the model); what the server asks of each type is
    in :mod:`.protocols`."""
    if config.job_type == JobType.TRAINING:
        from arctic_rl.server.engines.training import TrainingEngine

        if job_dir is None:
            raise ValueError("a training engine needs a job directory")
        return TrainingEngine(config, settings, job_dir)
    if config.job_type == JobType.LOG_PROB:
        from arctic_rl.server.engines.logprob_engine import LogProbEngine

        return LogProbEngine(config, settings)
    if config.job_type == JobType.SAMPLING:
        from arctic_rl.server.engines.sampler_choice import resolve_sampler

        if resolve_sampler(settings.sampler, settings.device) == "vllm":
            from arctic_rl.server.engines.vllm_sampler import VllmSamplingEngine

            return VllmSamplingEngine(config, settings)
        from arctic_rl.server.engines.sampling import SamplingEngine

        return SamplingEngine(config, settings)
    raise ValueError(f"job_type: expected one of {[t.value for t in JobType]}, got {config.job_type!r}")
