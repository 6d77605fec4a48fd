"""The shared-buffer weight sync of ``--vllm-engine-process own`` (:mod:`arctic_rl.server.engines.ipc_weights`,
:mod:`arctic_rl.server.engines.vllm_worker_ext`, :mod:`arctic_rl.server.engines.vllm_process`), on the CPU.

The layout (buckets, aligned offsets, a tensor larger than a bucket alone), the sender's copies and casts into one
reused buffer, and the worker's side reading them back into a real model's ``load_weights``, with the buffer handed
over in this process (the CUDA IPC handle itself is a GPU test's: ``test_vllm_engine_process_gpu.py``); the modes'
refusals and the own process's prefix-cache reset retried until the engine lets it go.
"""

from __future__ import annotations

import os

import pytest
import torch

from arctic_rl.server.engines import vllm_worker_ext
from arctic_rl.server.engines.ipc_weights import ALIGN, Entry, IpcWeightSender, plan_buckets, views
from arctic_rl.server.engines.vllm_process import ENV, OwnProcess, SameProcess, engine_process
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.settings import ServerSettings
from tests.support.vllm_stand_in import StepwiseLLM


def test_buckets_keep_order_align_offsets_and_give_an_oversized_tensor_its_own():
    records = [("a", "bfloat16", (10,)), ("b", "float32", (3, 5)), ("big", "bfloat16", (1000,)), ("c", "int64", (2,))]
    buckets = plan_buckets(records, cap=1024)
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["big"], ["c"]]
    a, b = buckets[0]
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 20, ALIGN, 60)
    assert buckets[1][0].offset == 0 and buckets[1][0].nbytes == 2000  # larger than the cap: alone
    assert plan_buckets([]) == []


def test_a_layout_record_travels_as_plain_values_and_a_bad_one_is_refused():
    entry = Entry("w", "bfloat16", (2, 3), 512)
    assert entry.to_wire() == ["w", "bfloat16", [2, 3], 512] and Entry.from_wire(entry.to_wire()) == entry
    with pytest.raises(ValueError, match=r"dtype: .*allowed: .*'bfloat16'.*received 'complex64'"):
        Entry.from_wire(["w", "complex64", [2], 0])
    with pytest.raises(ValueError, match=r"entries: tensor w lies at bytes 0\.\.12, outside the shared buffer's 8"):
        views(torch.zeros(8, dtype=torch.uint8), [Entry("w", "bfloat16", (6,), 0)])


class _Model(torch.nn.Module):
    """A real module with vLLM's model interface for weights: ``load_weights`` of ``(name, tensor)`` pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16, dtype=torch.bfloat16)
        self.embed = torch.nn.Embedding(32, 8, dtype=torch.bfloat16)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def load_weights(self, weights):
        own = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        loaded = set()
        with torch.no_grad():
            for name, value in weights:
                own[name].copy_(value)
                loaded.add(name)
        return loaded


class _Worker(vllm_worker_ext.ArcticWorkerExtension):
    """vLLM's worker as far as the extension reads it: ``model_runner.model``."""

    def __init__(self) -> None:
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = _Model()


def _handed_over_in_process(monkeypatch):
    """A sender's ``describe`` for this process: the buffer itself stands for its CUDA IPC handle, and the worker's
    ``open_shared`` finds it by that handle (CUDA IPC itself is the GPU test's)."""
    handed: dict[int, torch.Tensor] = {}

    def describe(buffer):
        handed[id(buffer)] = buffer
        return {"handle": id(buffer)}

    monkeypatch.setattr(vllm_worker_ext, "open_shared", lambda desc, device_index: handed[desc["handle"]])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return describe


def _trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"proj.weight": torch.randn(16, 8, generator=g), "proj.bias": torch.randn(16, generator=g),
            "embed.weight": torch.randn(32, 8, generator=g), "steps": torch.tensor([seed, 2, 3])}


@pytest.mark.parametrize(("cap", "groups"), [
    (1 << 20, [["proj.weight", "proj.bias", "embed.weight", "steps"]]),
    (300, [["proj.weight", "proj.bias"], ["embed.weight"], ["steps"]]),  # 256 + 32 bf16 bytes fit 300, 512 alone
], ids=["one-bucket", "three-buckets"])
def test_the_sender_lays_weights_out_and_the_worker_loads_them_cast_to_the_samplers_dtype(monkeypatch, cap, groups):
    worker = _Worker()
    sender = IpcWeightSender(torch.device("cpu"), torch.bfloat16, cap=cap,
                             describe=_handed_over_in_process(monkeypatch))
    calls = []

    def load(desc, entries):
        calls.append([e[0] for e in entries])
        return worker.arctic_load_shared(desc, entries)

    for seed in (1, 2):
        weights = _trainer_weights(seed)
        assert sender.send(weights, load) == 4
        state = worker.model_runner.model.state_dict()
        for name, value in weights.items():
            want = value.to(torch.bfloat16) if value.is_floating_point() else value
            assert state[name].dtype == want.dtype and torch.equal(state[name], want), name
    assert calls == groups * 2
    assert sender.allocations == 1  # the same buffer for the second sync
    assert worker.arctic_close_shared() is True and worker.arctic_close_shared() is False


def test_a_larger_bucket_gets_a_new_buffer(monkeypatch):
    sender = IpcWeightSender(torch.device("cpu"), torch.float32, describe=lambda buffer: {"handle": id(buffer)})
    sender.send({"w": torch.ones(4)}, lambda desc, entries: len(entries))
    sender.send({"w": torch.ones(4096)}, lambda desc, entries: len(entries))
    assert sender.allocations == 2


def test_the_modes_and_their_refusals(monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(engine_process("same", cpu, torch.float32), SameProcess)
    own = engine_process("own", cpu, torch.bfloat16)
    assert own.llm_options() == {"worker_extension_cls": vllm_worker_ext.EXTENSION}
    assert engine_process("same", cpu, torch.float32).llm_options() == {}
    with pytest.raises(ValueError, match=r"vllm_engine_process: expected one of \['same', 'own'\], got 'other'"):
        engine_process("other", cpu, torch.float32)
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(RuntimeError, match=rf"{ENV}: --vllm-engine-process own .*allowed: unset or 1, received '0'"):
        own.claim_env()
    monkeypatch.delenv(ENV)
    own.claim_env()
    assert os.environ[ENV] == "1"
    assert ServerSettings().vllm_engine_process == "same"
    with pytest.raises(ValueError, match=r"vllm_engine_process: expected one of \['same', 'own'\], got 'both'"):
        ServerSettings(vllm_engine_process="both")


class _Core:
    """An engine core that holds its KV blocks for ``busy`` more resets (the step it still runs for aborted calls)."""

    def __init__(self, busy: int) -> None:
        self.busy, self.resets = busy, 0

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return self.resets > self.busy


def test_the_own_process_retries_the_prefix_cache_reset_until_the_engine_core_lets_go():
    own = OwnProcess(torch.device("cpu"), torch.bfloat16)
    core = _Core(busy=3)
    own.settle(core)
    assert core.resets == 4
    own.settle_timeout_s = 0.02
    with pytest.raises(RuntimeError, match="still holds KV blocks"):
        own.settle(_Core(busy=10**9))


class _ApartLLM(StepwiseLLM):
    """``vllm.LLM`` with its engine core apart, as far as a weight load reaches it: ``collective_rpc`` calls the
    worker's method by name and reports its failure as vLLM's client does (a plain ``Exception`` with the text)."""

    def __init__(self, worker: _Worker, fault: str | None = None) -> None:
        super().__init__()
        self.worker, self.fault = worker, fault

    def collective_rpc(self, fn, args=(), kwargs=None):
        try:
            if self.fault:
                raise RuntimeError(self.fault)
            return [getattr(self.worker, fn)(*args, **(kwargs or {}))]
        except Exception as exc:  # noqa: BLE001 -- any failure, reported as vLLM's client reports it
            raise Exception(f"Call to {fn} method failed: {exc}") from None  # noqa: TRY002


def _own(monkeypatch) -> OwnProcess:
    own = OwnProcess(torch.device("cpu"), torch.bfloat16)
    own.sender.describe = _handed_over_in_process(monkeypatch)
    return own


def test_the_sampler_syncs_into_an_engine_core_apart_and_blames_the_right_side(monkeypatch,
                                                                                vllm_stand_in_sampler_around):
    worker = _Worker()
    sampler = vllm_stand_in_sampler_around(_ApartLLM(worker), process=_own(monkeypatch))
    weights = _trainer_weights(5)
    assert sampler.load_weights(weights) == 8
    assert torch.equal(worker.model_runner.model.state_dict()["proj.weight"], weights["proj.weight"].bfloat16())

    with pytest.raises(BadRequest) as wrong:  # a model that does not take these names: the caller's fault
        sampler.load_weights({**weights, "lm_head.weight": torch.ones(2)})
    assert wrong.value.field == "target_sub_job_ids" and "lm_head.weight" in wrong.value.message
    assert sampler.weight_version == 8

    broken = vllm_stand_in_sampler_around(_ApartLLM(worker, fault="CUDA error: an illegal memory access"),
                                          process=_own(monkeypatch))
    with pytest.raises(RuntimeError, match="CUDA error"):  # the device's fault: a 500, not a 400
        broken.load_weights(weights)


def test_with_the_engine_core_apart_the_memory_report_reaches_it_from_the_loop_thread(monkeypatch,
                                                                                      vllm_stand_in_sampler_around):
    """vLLM's client to an engine core apart is not thread-safe: a ``/status`` read must not call it beside the loop."""
    import threading

    threads = []

    class Recording(_ApartLLM):
        def collective_rpc(self, fn, args=(), kwargs=None):
            threads.append(threading.current_thread().name)
            return super().collective_rpc(fn, args, kwargs)

    worker = _Worker()
    sampler = vllm_stand_in_sampler_around(Recording(worker), process=_own(monkeypatch))
    sampler.device = torch.device("cpu")
    parts = sampler.memory_report()
    assert parts["weights"] == sum(p.numel() * p.element_size() for p in worker.model_runner.model.parameters())
    assert threads == ["arctic-vLLM sampler-loop"]  # the generation loop's thread (continuous.py names it)
