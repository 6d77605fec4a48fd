"""A weight sync's work (``jobs/weight_sync.py``): the loads, then the caching allocator's unused blocks released
(``--release-at-sync``, on by default).

The setting is checked naming the field; real jobs in a real :class:`ServerState` (tiny Qwen3 on the CPU: a training
job, the ``transformers`` sampler, a log-prob job) sync their weights with the device's memory functions replaced by
a recording stand-in (on a CPU the real ones read 0 and do nothing): with ``on`` the release runs once per sync,
after every target's load, on the training job's device, and the answer carries its figures; with ``off`` it never
runs and the answer has no such fields. Either way the targets get the new version.
"""

from __future__ import annotations

import asyncio

import pytest

from arctic_rl.protocol import JobConfig, JobType, WeightSyncRequest
from arctic_rl.server.engines import device_memory
from arctic_rl.server.jobs.service import ServerState
from arctic_rl.server.settings import RELEASE_AT_SYNC_MODES, ServerSettings

pytestmark = pytest.mark.slow

GIB = 1 << 30


class RecordingMemory:
    """What the release sees: a reserve that drops from 9 GiB to 2 GiB at ``empty_cache``; events in order."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.devices: list[str] = []
        self.reserved = 9 * GIB

    def of(self, device) -> device_memory.DeviceMemory:
        self.devices.append(str(device))
        return device_memory.DeviceMemory(reserved=lambda: self.reserved, empty_cache=self._empty, on_device=True)

    def _empty(self) -> None:
        self.events.append("release")
        self.reserved = 2 * GIB


def test_the_setting_is_checked_naming_the_field():
    assert RELEASE_AT_SYNC_MODES == ("on", "off") and ServerSettings().release_at_sync == "on"
    with pytest.raises(ValueError, match=r"release_at_sync: expected one of \['on', 'off'\], got 'yes'"):
        ServerSettings(release_at_sync="yes")


@pytest.mark.parametrize("mode", RELEASE_AT_SYNC_MODES)
def test_a_sync_releases_the_unused_blocks_after_its_loads(tiny_model_dir, tmp_path, monkeypatch, mode):
    events: list[str] = []
    memory = RecordingMemory(events)
    monkeypatch.setattr(device_memory.DeviceMemory, "of", staticmethod(memory.of))

    async def run() -> tuple[dict, dict[int, int]]:
        state = ServerState(ServerSettings(checkpoint_root=tmp_path / mode, release_at_sync=mode, warm_up="off"))
        try:
            ids = {}
            for job_type in (JobType.TRAINING, JobType.SAMPLING, JobType.LOG_PROB):
                config = JobConfig(model_name=str(tiny_model_dir), job_type=job_type, checkpoint_path="train",
                                   ds_config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
                ids[job_type] = (await state.initialize(config))["job_id"]
            for job_type in (JobType.SAMPLING, JobType.LOG_PROB):
                engine = state.jobs.get(ids[job_type]).engine
                real = engine.load_weights

                def load(weights, real=real, name=job_type.value):
                    events.append(f"load {name}")
                    return real(weights)

                engine.load_weights = load
            events.clear()  # the jobs' building may release too (the samplers' sleep around it)
            memory.devices.clear()
            memory.reserved = 9 * GIB
            request = WeightSyncRequest(source_sub_job_id=ids[JobType.TRAINING],
                                        target_sub_job_ids=[ids[JobType.SAMPLING], ids[JobType.LOG_PROB]])
            answer = await state.weight_sync(ids[JobType.TRAINING], request)
            versions = {ids[t]: state.jobs.get(ids[t]).engine.weight_version for t in (JobType.SAMPLING,
                                                                                       JobType.LOG_PROB)}
            return answer, versions
        finally:
            state.shutdown()

    answer, versions = asyncio.run(run())
    assert answer["weight_versions"] == {str(k): v for k, v in versions.items()} and set(versions.values()) == {1}
    if mode == "on":
        assert events == ["load sampling", "load log_prob", "release"]
        assert memory.devices == ["cpu"]  # the training job's device
        assert answer["allocator_reserved_before_bytes"] == 9 * GIB
        assert answer["allocator_reserved_after_bytes"] == 2 * GIB
        assert answer["allocator_released_bytes"] == 7 * GIB
    else:
        assert events == ["load sampling", "load log_prob"] and memory.devices == []
        assert not any(key.startswith("allocator_") for key in answer)
