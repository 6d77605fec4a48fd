"""Fixtures shared by the sampling engines' tests: the ``transformers`` sampler on the tiny model, and the vLLM
sampler around the step-wise stand-in of vLLM's engine (``tests/support/vllm_stand_in.py``)."""

from __future__ import annotations

import sys

import pytest

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.settings import ServerSettings


@pytest.fixture(scope="module")
def hf_sampler(tiny_model_dir):
    """A ``transformers`` sampling engine on the tiny model, on the CPU (one per test module)."""
    from arctic_rl.server.engines.sampling import SamplingEngine

    eng = SamplingEngine(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.SAMPLING),
                         ServerSettings(device="cpu"))
    yield eng
    eng.close()


@pytest.fixture
def vllm_stand_in_sampler(monkeypatch):
    """The vLLM sampling engine around :class:`StepwiseLLM` (weight version 7, a 100-token vocabulary); its
    generation loop is closed after the test."""
    from tests.support.vllm_stand_in import StepwiseLLM, engine_around, vllm_stand_in_modules

    for name, module in vllm_stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    eng = engine_around(StepwiseLLM(), vocab_size=100, max_model_len=4096, weight_version=7)
    eng.options, eng.device, eng.dtype, eng.sleep_level = {"gpu_memory_utilization": 0.4}, "cpu", "float32", 0
    yield eng
    loop = eng.__dict__.get("_generation_loop")
    if loop is not None:
        loop.close()
