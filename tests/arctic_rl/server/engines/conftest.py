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
def vllm_stand_in_sampler_around(monkeypatch):
    """``around(llm, full_determinism=False, process=None)``: the vLLM sampling engine around a stand-in ``llm``
    (``tests/support/vllm_stand_in.py``; weight version 7, a 100-token vocabulary), with the stand-in vLLM modules
    installed; every engine's generation loop is closed after the test."""
    from tests.support.vllm_stand_in import engine_around, vllm_stand_in_modules

    for name, module in vllm_stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    made = []

    def around(llm, full_determinism: bool = False, process=None):
        eng = engine_around(llm, vocab_size=100, max_model_len=4096, weight_version=7,
                            full_determinism=full_determinism, process=process)
        eng.options, eng.device, eng.dtype, eng.sleep_level = {"gpu_memory_utilization": 0.4}, "cpu", "float32", 0
        made.append(eng)
        return eng

    yield around
    for eng in made:
        loop = eng.__dict__.get("_generation_loop")
        if loop is not None:
            loop.close()


@pytest.fixture
def vllm_stand_in_sampler(vllm_stand_in_sampler_around):
    """The vLLM sampling engine around :class:`StepwiseLLM` (see :func:`vllm_stand_in_sampler_around`)."""
    from tests.support.vllm_stand_in import StepwiseLLM

    return vllm_stand_in_sampler_around(StepwiseLLM())
