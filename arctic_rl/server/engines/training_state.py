"""The training engine's checkpoints: DeepSpeed's own (module, optimizer, scheduler, step) plus RNG states, in the
layout of :mod:`arctic_rl.server.jobs.checkpoint`, and the Hugging Face export (under ZeRO-3, of the gathered weights).

On CUDA a save logs the device memory it used while it ran and how much of that PyTorch's caching allocator did not
hold (:meth:`~arctic_rl.server.engines.device_memory.DeviceMemory.watch`): a save's memory is gone by its end, so
neither the allocator's figures after it nor the job's memory report show it. The line also gives the freed blocks the
allocator kept cached when the save began (after a ``/step``, DeepSpeed's flat fp32 gradient copy: in sync mode the
sampler's next wake releases them, which a save delays).

What is not here: the engine (:mod:`arctic_rl.server.engines.training`), paths and HTTP.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from arctic_rl.server.engines.common import load_tokenizer
from arctic_rl.server.engines.device_memory import DeviceMemory
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.jobs import checkpoint as ckpt_layout

__all__ = ["load_training", "save_training"]

logger = logging.getLogger("arctic_rl.server")


def save_training(trainer: Any, ckpt: Path, *, export_hf: bool) -> dict[str, Any]:
    """Write model + optimizer + scheduler + step + RNG to ``ckpt`` (``.../checkpoint-<step>``)."""
    if trainer.pending:
        logger.warning("save: the gradients of a /forward-backward not closed by /step are not in the checkpoint")
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    device_memory = DeviceMemory.of(trainer.device)
    with device_memory.watch() as seen:
        trainer.engine.save_checkpoint(str(ckpt.parent), tag=ckpt.name, save_latest=False)
        ckpt_layout.save_rng_state(ckpt)
        marker = {"global_step": trainer.global_step, "model_name": trainer.config.model_name,
                  "zero_stage": trainer.zero_stage}
        ckpt_layout.write_marker(ckpt, marker)
        hf_path = None
        if export_hf:
            hf_dir = ckpt / "hf"
            state = trainer.weights() if trainer.zero_stage == 3 else None  # ZeRO-3: the gathered weights
            trainer.model.save_pretrained(str(hf_dir), safe_serialization=True, state_dict=state)
            load_tokenizer(trainer.tokenizer_source).save_pretrained(str(hf_dir))
            hf_path = str(hf_dir)
    if device_memory.on_device:
        mib = {key: value / 2**20 for key, value in seen.items()}
        logger.info("save: the device's use rose by %.0f MiB at most during the save (%.0f MiB of it outside PyTorch's "
                    "allocator, whose reserve rose by %.0f MiB at most); %.0f MiB left at its end; at its start the "
                    "allocator held %.0f MiB of freed blocks cached (in use on the device, not by tensors)",
                    mib["grown_max"], mib["grown_outside_allocator_max"], mib["reserved_grown_max"], mib["grown_after"],
                    mib["unused_reserved_at_start"])
    return {"path": str(ckpt), "hf_path": hf_path, "global_step": trainer.global_step}


def load_training(trainer: Any, ckpt: Path) -> dict[str, Any]:
    """Restore what :func:`save_training` wrote; the next step is the one the saved run would have taken."""
    if trainer.pending:
        logger.warning("load: discarding the gradients of a /forward-backward not closed by /step")
        trainer.discard_gradients()
        trainer.pending = 0
    path, _ = trainer.engine.load_checkpoint(
        str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise BadRequest(f"path: DeepSpeed found no checkpoint at {ckpt}", field="path", received=str(ckpt))
    ckpt_layout.load_rng_state(ckpt)
    return {"path": str(ckpt), "global_step": trainer.global_step}
