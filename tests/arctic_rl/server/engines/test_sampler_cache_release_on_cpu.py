"""The samplers' sleep and wake release PyTorch's unused cached blocks and say how much (no GPU here).

:class:`~arctic_rl.server.engines.device_memory.DeviceMemory` is injected: its ``reserved()`` reads a counter
that ``empty_cache()`` lowers, and every call is recorded. The vLLM sampler (around the stand-in engine of
``tests/support/vllm_stand_in.py``) releases the blocks after vLLM's sleep and before vLLM maps its memory again on
wake; the ``transformers`` sampler does the same around its state. Both answers carry
``allocator_reserved_before_bytes``, ``allocator_reserved_after_bytes`` and ``allocator_released_bytes``; on a CPU
device, without injection, they read 0.
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl.server.engines.device_memory import DeviceMemory
from arctic_rl.server.engines.sampling import SamplingEngine
from tests.support.vllm_stand_in import StepwiseLLM

FIELDS = ("allocator_reserved_before_bytes", "allocator_reserved_after_bytes", "allocator_released_bytes")
GIB = 1 << 30


class FakeAllocator:
    """9.9 GiB reserved of which 7.5 are in use: ``empty_cache`` drops the reserve to what is in use."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.reserved_bytes, self.in_use = events, int(9.9 * GIB), int(7.5 * GIB)

    def memory(self) -> DeviceMemory:
        def empty_cache() -> None:
            self.events.append("empty_cache")
            self.reserved_bytes = self.in_use

        return DeviceMemory(reserved=lambda: self.reserved_bytes, free=lambda: 0, empty_cache=empty_cache,
                            synchronize=lambda: self.events.append("synchronize"))


@pytest.fixture
def vllm_engine(vllm_stand_in_sampler_around):
    llm = StepwiseLLM()
    llm.events = []
    llm.sleep = lambda level: llm.events.append(f"sleep {level}")
    llm.wake_up = lambda tags=None: llm.events.append(f"wake {tags}")
    return vllm_stand_in_sampler_around(llm)


def test_release_unused_reports_the_reserve_before_and_after():
    allocator = FakeAllocator([])
    assert allocator.memory().release_unused() == {
        "allocator_reserved_before_bytes": int(9.9 * GIB), "allocator_reserved_after_bytes": int(7.5 * GIB),
        "allocator_released_bytes": int(9.9 * GIB) - int(7.5 * GIB)}
    assert allocator.events == ["empty_cache"]
    assert allocator.memory().unchanged() == dict(zip(FIELDS, (int(7.5 * GIB), int(7.5 * GIB), 0), strict=True))
    for device in ("cpu", torch.device("cpu"), None):  # nothing is reserved on CPU: every field 0
        assert DeviceMemory.of(device).release_unused() == dict.fromkeys(FIELDS, 0)


def test_vllm_sampler_releases_cached_blocks_after_sleep_and_before_wake(vllm_engine):
    allocator = FakeAllocator(vllm_engine.llm.events)
    vllm_engine.device_memory = allocator.memory()
    slept = vllm_engine.sleep(level=1)
    assert vllm_engine.llm.events == ["synchronize", "sleep 1", "empty_cache"]
    assert slept["status"] == "sleeping" and slept["allocator_released_bytes"] == int(9.9 * GIB) - int(7.5 * GIB)
    assert vllm_engine.sleep(level=1)["allocator_released_bytes"] == 0  # already asleep: nothing done
    allocator.reserved_bytes = int(9.9 * GIB)  # the training phase left its reserve
    vllm_engine.llm.events.clear()
    woke = vllm_engine.wake_up()
    assert vllm_engine.llm.events == ["empty_cache", "wake ['weights', 'kv_cache']"]  # released first
    assert woke["status"] == "awake" and {k: woke[k] for k in FIELDS} == {
        "allocator_reserved_before_bytes": int(9.9 * GIB), "allocator_reserved_after_bytes": int(7.5 * GIB),
        "allocator_released_bytes": int(9.9 * GIB) - int(7.5 * GIB)}
    again = vllm_engine.wake_up()  # awake already: nothing released
    assert again["woken"] == [] and again["allocator_released_bytes"] == 0
    assert vllm_engine.llm.events.count("empty_cache") == 1


def test_vllm_sampler_answers_carry_the_fields_on_cpu(vllm_engine):
    """No injection: the CPU's functions (the CUDA ones are taken only for a CUDA device)."""
    slept, woke = vllm_engine.sleep(level=2), vllm_engine.wake_up(["weights", "kv_cache"])
    for answer in (slept, woke):
        assert {k: answer[k] for k in FIELDS} == dict.fromkeys(FIELDS, 0)
    assert woke["woken"] == ["weights", "kv_cache"] and slept["freed_bytes"] == 0


def test_transformers_sampler_releases_cached_blocks_around_sleep():
    engine = SamplingEngine.__new__(SamplingEngine)  # sleep and wake only record state: no model needed
    engine.asleep, engine.weight_version, engine.device = set(), 3, torch.device("cpu")
    for answer in (engine.sleep(1), engine.wake_up(None)):
        assert {k: answer[k] for k in FIELDS} == dict.fromkeys(FIELDS, 0)
    events: list[str] = []
    allocator = FakeAllocator(events)
    engine.device_memory = allocator.memory()
    assert engine.sleep(1)["allocator_released_bytes"] == int(9.9 * GIB) - int(7.5 * GIB)
    allocator.reserved_bytes = int(9.9 * GIB)
    woke = engine.wake_up(["kv_cache"])
    assert woke["status"] == "partly_awake" and woke["asleep"] == ["weights"]
    assert woke["allocator_reserved_after_bytes"] == int(7.5 * GIB) and events == ["empty_cache", "empty_cache"]
    assert engine.wake_up(["kv_cache"])["allocator_released_bytes"] == 0  # nothing left to wake there


def test_growth_outside_the_allocator_is_the_devices_growth_minus_the_reserves():
    """What vLLM's start leaves outside PyTorch's allocator: 3 GiB more in use on the device, 1 GiB of it reserved."""
    events: list[str] = []
    state = {"free": 100 * GIB, "reserved": 2 * GIB}
    mem = DeviceMemory(reserved=lambda: state["reserved"], free=lambda: state["free"],
                       synchronize=lambda: events.append("synchronize"))
    start = mem.mark()
    state["free"] -= 3 * GIB
    state["reserved"] += 1 * GIB
    assert mem.grown_outside_allocator(start) == 2 * GIB
    assert events == ["synchronize", "synchronize"]  # both readings after the device's work
    assert DeviceMemory().grown_outside_allocator(DeviceMemory().mark()) == 0  # the CPU's: nothing to measure
