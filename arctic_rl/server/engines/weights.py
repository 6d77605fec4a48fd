"""Weight transfer between engines of one process (what ``/weight-sync`` does here).

The reference server holds every job in one process, so a sync is a tensor copy: the training
model's state dict is copied, name by name, into the target model (cast to its dtype and
device). Names and shapes must match exactly -- a target built from another model is a 400. A ZeRO-3
target (``partitioned=True``) is written one parameter at a time, each gathered whole for its copy and
partitioned again after it.
The real Arctic server does this over NCCL or CUDA IPC between processes; that is not here.
:func:`weight_norm` is what ``/weight-norm`` compares after a sync. The vLLM sampler's copy and norm run inside
vLLM's worker (in this process, through ``collective_rpc``): :func:`vllm_worker_load`, :func:`vllm_worker_weight_norm`.
"""

from __future__ import annotations

from typing import Any

import torch

from arctic_rl.server.errors import BadRequest

__all__ = ["copy_weights", "is_device_fault", "vllm_worker_load", "vllm_worker_weight_norm", "weight_norm"]


def copy_weights(target: torch.nn.Module, weights: dict[str, torch.Tensor], *, partitioned: bool = False) -> int:
    """Copy ``weights`` into ``target`` in place; returns the number of tensors copied. ``partitioned``: the
    target's parameters are ZeRO-3 partitions (empty between passes; their whole shape is ``ds_shape``)."""
    own = target.state_dict()
    params = dict(target.named_parameters(remove_duplicate=False)) if partitioned else {}
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        raise BadRequest(
            "target_sub_job_ids: the target job's model does not match the training model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})",
            field="target_sub_job_ids",
        )
    for name, tensor in own.items():
        shape = tuple(getattr(params[name], "ds_shape", tensor.shape)) if name in params else tuple(tensor.shape)
        if shape != tuple(weights[name].shape):
            raise BadRequest(
                f"target_sub_job_ids: tensor {name} has shape {list(shape)} in the target, "
                f"{list(weights[name].shape)} in the training model",
                field="target_sub_job_ids",
            )
    with torch.no_grad():
        for name, tensor in own.items():
            if name in params:
                _copy_partitioned(params[name], weights[name])
            else:
                tensor.copy_(weights[name].detach().to(device=tensor.device, dtype=tensor.dtype))
    return len(own)


def _copy_partitioned(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write ``value`` into a ZeRO-3 parameter: gathered whole, copied, partitioned again on leaving."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        param.data.copy_(value.detach().to(device=param.device, dtype=param.dtype))


def weight_norm(model: torch.nn.Module) -> dict[str, float | int]:
    """Global L2 norm of ``model``'s parameters (fp64 sum of squares) and their count, as the vendor's
    ``/weight-norm`` reports it: equal for two models holding the same weights, whatever their layout."""
    sq_sum, count = 0.0, 0
    with torch.no_grad():
        for p in model.parameters():
            sq_sum += float(p.detach().double().pow(2).sum())
            count += 1
    return {"norm": sq_sum**0.5, "sq_sum": sq_sum, "num_params": count}


def is_device_fault(exc: BaseException) -> bool:
    """Whether a weight copy failed in the device (a CUDA error: the server's fault, a 500), not on the weights' names or
    shapes (the caller's, a 400)."""
    return isinstance(exc, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(exc)


def vllm_worker_load(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside vLLM's worker: copy ``weights`` into its live model; the number of tensors loaded."""
    loaded = worker.model_runner.model.load_weights(weights=weights)
    return len(loaded) if loaded is not None else len(weights)


def vllm_worker_weight_norm(worker: Any) -> dict[str, float | int]:
    """Runs inside vLLM's worker: :func:`weight_norm` of its live model."""
    return weight_norm(worker.model_runner.model)
