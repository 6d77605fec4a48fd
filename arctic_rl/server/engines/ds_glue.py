"""What the training engine needs around DeepSpeed: its import, the module it wraps, and ZeRO-3's gathering.

* :func:`import_deepspeed` -- ``deepspeed`` for a device (the CPU accelerator on CPU), with the
  shared-memory all-reduce op disabled so nothing is JIT-built;
* :class:`PolicyModule` -- the module handed to ``deepspeed.initialize``: its forward takes the whole
  computation as a function of the model, so DeepSpeed's hooks see any pass as they see ``engine(batch)``;
  :class:`Carry` returns other values from it without DeepSpeed hooking them;
* :func:`gathered_state_dict` -- under ZeRO-3 each parameter is a partition between passes: a full copy of
  the state dict, gathered (what a weight sync or an HF export reads).

What is not here: the engine's calls (:mod:`arctic_rl.server.engines.training`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["Carry", "PolicyModule", "gathered_state_dict", "import_deepspeed"]


class PolicyModule(torch.nn.Module):
    """``forward(fn)`` returns ``fn(model)``: any computation on the model, run by DeepSpeed."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn):
        return fn(self.model)


class Carry:
    """Opaque holder: DeepSpeed registers backward hooks on output tensors it can see, only."""

    def __init__(self, value: Any) -> None:
        self.value = value


def import_deepspeed(device: torch.device):
    """``deepspeed``, imported for ``device`` (the CPU accelerator on CPU) without JIT-building its shm op."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator would JIT-build a shared-memory all-reduce op (~46 s) on first use.
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    return deepspeed


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of a ZeRO-3-partitioned ``model``'s state dict with every parameter whole (the model's size)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return {name: t.detach().clone() for name, t in model.state_dict().items()}
