"""Where the vLLM sampler's engine core runs, and what that changes: one object per ``--vllm-engine-process`` mode.

* :class:`SameProcess` (``same``, the default): ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the engine core -- scheduler,
  model, KV cache -- in the server's process. A weight load hands the training job's live tensors to the model
  (:func:`.weights.vllm_worker_load` through ``collective_rpc``); the weight norm and the memory parts are read the
  same way; :func:`.vllm_steps.settle` steps the engine itself until its prefix cache can be reset.
* :class:`OwnProcess` (``own``): ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's engine core in a process of its own
  (the server keeps the ``LLMEngine`` front: request intake and output processing). While the server's passes and
  generation run at once (asynchronous GRPO), the engine's scheduling then no longer takes turns with the passes for
  the server's interpreter lock. The worker gets :mod:`.vllm_worker_ext`'s methods (``worker_extension_cls``), called
  by name; a weight load goes through a shared CUDA buffer (:mod:`.ipc_weights`); the engine core steps on its own, so
  the prefix-cache reset after taking calls out is retried until the step it may still run for them has ended. vLLM's
  client to the engine core is not thread-safe, so every call reaches it from the sampler's loop thread (the memory
  report too, which in one process is read from any thread).

The sampler (:mod:`.vllm_sampler`) owns its record of versions, sleep and calls; these objects only reach the engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from arctic_rl.server.engines.ipc_weights import IpcWeightSender
from arctic_rl.server.engines.vllm_steps import settle
from arctic_rl.server.engines.vllm_worker_ext import EXTENSION
from arctic_rl.server.engines.weights import vllm_worker_load, vllm_worker_weight_norm
from arctic_rl.server.memory import vllm_worker_parts

__all__ = ["ENV", "OwnProcess", "SameProcess", "engine_process"]

logger = logging.getLogger("arctic_rl.server")

#: vLLM's switch between its engine core in this process (``0``) and in a process of its own (``1``)
ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class _Mode:
    mode = ""
    env_value = ""  #: vLLM's switch (:data:`ENV`) for this mode

    def claim_env(self) -> None:
        """Set vLLM's switch for this mode before the engine is built; refuse a conflicting value the server was
        started with."""
        found = os.environ.setdefault(ENV, self.env_value)
        if found != self.env_value:
            raise RuntimeError(f"{ENV}: --vllm-engine-process {self.mode} runs vLLM's engine core with "
                               f"{ENV}={self.env_value} (allowed: unset or {self.env_value}, received {found!r})")


class SameProcess(_Mode):
    """The engine core in the server's process (the module docstring)."""

    mode, env_value = "same", "0"
    rpc_from_any_thread = True  #: ``collective_rpc`` runs the worker's function in place: any thread may call it

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        pass

    def llm_options(self) -> dict[str, Any]:
        return {}

    def load(self, llm: Any, weights: Mapping[str, torch.Tensor]) -> int:
        items = [(name, tensor.detach()) for name, tensor in weights.items()]
        return sum(int(n) for n in llm.collective_rpc(vllm_worker_load, args=(items,)))

    def settle(self, llm: Any) -> None:
        settle(llm)

    def weight_norm(self, llm: Any) -> dict[str, Any]:
        return llm.collective_rpc(vllm_worker_weight_norm)[0]

    def memory_parts(self, llm: Any) -> dict[str, int]:
        return llm.collective_rpc(vllm_worker_parts)[0]

    def close(self, llm: Any) -> None:
        pass


class OwnProcess(_Mode):
    """The engine core in a process of its own (the module docstring)."""

    mode, env_value = "own", "1"
    #: vLLM's client to the engine core writes to one ZeroMQ socket with no lock: every call (requests, steps, calls of
    #: the worker's methods) must come from the sampler's loop thread
    rpc_from_any_thread = False
    #: how long :meth:`settle` retries the prefix-cache reset, and the pause between tries
    settle_timeout_s = 5.0
    settle_pause_s = 0.005

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.sender = IpcWeightSender(device, dtype)

    def llm_options(self) -> dict[str, Any]:
        return {"worker_extension_cls": EXTENSION}

    def load(self, llm: Any, weights: Mapping[str, torch.Tensor]) -> int:
        def load_bucket(desc: dict[str, Any], entries: list[list[Any]]) -> int:
            try:
                return int(llm.collective_rpc("arctic_load_shared", args=(desc, entries))[0])
            except Exception as exc:
                if type(exc) is Exception:  # vLLM's client reports the engine core's failure with its text only
                    raise RuntimeError(str(exc)) from None  # the sampler tells the weights' fault from the device's
                raise

        return self.sender.send(weights, load_bucket)

    def settle(self, llm: Any) -> None:
        deadline = time.monotonic() + self.settle_timeout_s
        while not llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's engine core still holds KV blocks {self.settle_timeout_s:.0f} s after the "
                                   "calls in flight were taken out of it")
            time.sleep(self.settle_pause_s)

    def weight_norm(self, llm: Any) -> dict[str, Any]:
        return llm.collective_rpc("arctic_weight_norm")[0]

    def memory_parts(self, llm: Any) -> dict[str, int]:
        return llm.collective_rpc("arctic_memory_parts")[0]

    def close(self, llm: Any) -> None:
        """Let the engine core drop the shared buffer, then drop it here."""
        try:
            llm.collective_rpc("arctic_close_shared")
        except Exception as exc:  # noqa: BLE001 -- an engine core already gone has nothing open
            logger.debug("vLLM engine core did not close the shared weight buffer: %s", exc)
        self.sender.close()


def engine_process(mode: str, device: torch.device, dtype: torch.dtype) -> SameProcess | OwnProcess:
    """The object for ``--vllm-engine-process mode``."""
    kinds = {cls.mode: cls for cls in (SameProcess, OwnProcess)}
    if mode not in kinds:
        raise ValueError(f"vllm_engine_process: expected one of {list(kinds)}, got {mode!r}")
    return kinds[mode](device, dtype)
