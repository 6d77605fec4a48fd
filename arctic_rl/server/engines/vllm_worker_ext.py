"""Methods the vLLM sampler adds to vLLM's GPU worker when the engine core runs in a process of its own.

vLLM mixes the class named by its ``worker_extension_cls`` engine option into its worker, and ``collective_rpc`` then
calls these methods by name -- across the process boundary, with arguments and answers carried by vLLM's message
encoding (plain values: no function and no tensor travels, so vLLM's pickle fallback stays off). The sampler passes
``worker_extension_cls`` only with ``--vllm-engine-process own`` (:mod:`.vllm_sampler`); in one process it calls the
functions of :mod:`.weights` and :mod:`arctic_rl.server.memory` directly.

* :meth:`ArcticWorkerExtension.arctic_load_shared`: one bucket of a weight sync, read from the server's shared CUDA
  buffer (:mod:`.ipc_weights`);
* :meth:`ArcticWorkerExtension.arctic_weight_norm`: ``/weight-norm`` of the live model;
* :meth:`ArcticWorkerExtension.arctic_memory_parts`: the model's weights and KV cache bytes for ``/status``;
* :meth:`ArcticWorkerExtension.arctic_close_shared`: forget the opened buffer (before the server drops it).
"""

from __future__ import annotations

from typing import Any

import torch

from arctic_rl.server.engines.ipc_weights import Entry, open_shared, views
from arctic_rl.server.engines.weights import weight_norm
from arctic_rl.server.memory import vllm_worker_parts

__all__ = ["EXTENSION", "ArcticWorkerExtension"]

#: the dotted name vLLM's ``worker_extension_cls`` takes
EXTENSION = f"{__name__}.ArcticWorkerExtension"


class ArcticWorkerExtension:
    """Mixed into vLLM's worker (``self`` is the worker: ``self.model_runner.model`` is the live model)."""

    def _arctic_shared(self, desc: dict[str, Any]) -> torch.Tensor:
        """The server's buffer, opened once per handle (a new buffer, a new handle: the old one is dropped)."""
        cached = getattr(self, "_arctic_buffer", None)
        if cached is None or cached[0] != desc["handle"]:
            device_index = torch.cuda.current_device()
            self._arctic_buffer = (desc["handle"], open_shared(desc, device_index))
        return self._arctic_buffer[1]

    def arctic_load_shared(self, desc: dict[str, Any], entries: list[list[Any]]) -> int:
        """Load the tensors ``entries`` lay out in the shared buffer into the live model; how many were loaded. The
        loads are finished on the device before this returns (the server refills the buffer next)."""
        buffer = self._arctic_shared(desc)
        weights = views(buffer, [Entry.from_wire(record) for record in entries])
        loaded = self.model_runner.model.load_weights(weights=weights)
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()
        return len(loaded) if loaded is not None else len(weights)

    def arctic_close_shared(self) -> bool:
        """Drop the opened buffer; whether there was one."""
        had = getattr(self, "_arctic_buffer", None) is not None
        self._arctic_buffer = None
        return had

    def arctic_weight_norm(self) -> dict[str, float | int]:
        return weight_norm(self.model_runner.model)

    def arctic_memory_parts(self) -> dict[str, int]:
        return vllm_worker_parts(self)
