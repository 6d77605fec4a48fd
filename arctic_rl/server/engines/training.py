"""The training engine: a DeepSpeed engine over a Hugging Face causal LM (one process).

* ``forward_backward`` -- one micro-batch: log-probs (:func:`~arctic_rl.server.logprobs.response_logprobs`,
  ZoRRO when enabled), the allow-listed loss (:func:`~arctic_rl.server.losses.compute_loss`) and
  ``engine.backward``. The forward runs *through* the DeepSpeed engine (the model is wrapped in
  :class:`_PolicyModule`, whose forward takes the whole computation as a function), so DeepSpeed's
  backward hooks see it exactly as with a plain ``engine(batch)``.
* ``step`` -- the optimizer step. ``gradient_accumulation_steps`` (GAS) is the number of
  ``forward_backward`` calls per step: DeepSpeed runs with ``managed_gradient_accumulation=false``
  and this engine counts the calls; a ``step`` after another number, or a ``forward_backward``
  beyond GAS, is a 400 naming both numbers. DeepSpeed divides each micro-batch loss by GAS (a
  mean over micro-batches); with ``loss_scale_tokens`` set that division is compensated, so the
  gradient is that of ``sum over the step's micro-batches of sum(loss * mask) / loss_scale_tokens``.
* ``forward`` -- no-grad log-probs (eval mode).
* ``save`` / ``load`` -- DeepSpeed's own checkpoint (module, optimizer, scheduler, step) plus
  RNG states, in the layout of :mod:`arctic_rl.server.checkpoint`.
* ``weights`` -- the live parameters by name, for weight sync.

What is not here: HTTP, request validation, path resolution.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from arctic_rl.protocol import JobConfig, JobType, LogprobAlignment
from arctic_rl.server import checkpoint as ckpt_layout
from arctic_rl.server.engines.common import (
    compile_model,
    ensure_process_group,
    forward_logprobs,
    load_model,
    load_tokenizer,
    model_vocab_size,
    resolve_compile_mode,
    resolve_device,
)
from arctic_rl.server.engines.config import build_training_ds_config, parse_worker_knobs
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.logprobs import set_compiled_token_stats
from arctic_rl.server.settings import ServerSettings
from arctic_rl.server.validation import ParsedBatch
from arctic_rl.server.zorro import set_response_attention

__all__ = ["TrainingEngine"]

logger = logging.getLogger("arctic_rl.server")


class _PolicyModule(torch.nn.Module):
    """``forward(fn)`` returns ``fn(model)``: any computation on the model, run by DeepSpeed."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn):
        return fn(self.model)


class _Carry:
    """Opaque holder: DeepSpeed registers backward hooks on output tensors it can see, only."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _import_deepspeed(device: torch.device):
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator would JIT-build a shared-memory all-reduce op (~46 s) on first use.
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    return deepspeed


class TrainingEngine:
    """One DeepSpeed training engine (see the module docstring)."""

    job_type = JobType.TRAINING

    def __init__(self, config: JobConfig, settings: ServerSettings, job_dir: Path) -> None:
        self.config = config
        self.job_dir = job_dir
        self.device = resolve_device(settings.device)
        self.knobs, unused, unknown = parse_worker_knobs(config.ds_worker_config)
        if unused:
            logger.info("training job: ds_worker_config keys accepted but not used here: %s", unused)
        if unknown:
            logger.info("training job: unknown ds_worker_config keys ignored: %s", unknown)
        bf16_ok = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.ds_config, notes = build_training_ds_config(
            config.ds_config, device=self.device.type, bf16_supported=bf16_ok
        )
        for note in notes:
            logger.info("training job: %s", note)
        if config.training_config:
            logger.info("training job: training_config is not used (the optimizer comes from ds_config)")

        deepspeed = _import_deepspeed(self.device)
        ensure_process_group(self.device)
        torch.manual_seed(config.seed)
        if config.full_determinism:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            logger.info("training job: full_determinism on (deterministic torch algorithms, process-wide)")
        dtype = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else torch.float32
        model = load_model(
            config.model_name, device=self.device, dtype=dtype, attn_implementation=self.knobs.attn_implementation
        )
        if self.knobs.enable_gradient_checkpointing and self.knobs.zorro_train_enable:
            # checkpointed layers re-run their forward in the backward, outside ZoRRO's hand-over of the
            # prompt's keys to its responses: ZoRRO (the explicit choice) wins.
            logger.warning(
                "training job: enable_gradient_checkpointing ignored because zorro_train_enable is on "
                "(checkpointed layers re-run without the shared prompt keys); ZoRRO already cuts activation memory"
            )
        elif self.knobs.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.vocab_size = model_vocab_size(model)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.tokenizer_source = config.model_name
        wrapper = _PolicyModule(model)
        params = [p for p in wrapper.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=wrapper, model_parameters=params, config=self.ds_config)
        self.torch_compile = resolve_compile_mode(settings.torch_compile, self.device)
        compile_model(self.model, self.torch_compile)  # after DeepSpeed wrapped it
        # where torch.compile works on a GPU, ZoRRO's response pass uses compiled FlexAttention (no prompt copies)
        set_response_attention("flex" if self.device.type == "cuda" and self.torch_compile != "off" else "expand")
        set_compiled_token_stats(self.torch_compile != "off")  # fused log-softmax / entropy chunks
        self.gas = int(self.engine.gradient_accumulation_steps())
        self.pending = 0  # forward_backward calls since the last step
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        logger.info(
            "training engine ready: %s, %s, ZeRO-%d, GAS=%d, lr=%s, zorro=%s, torch_compile=%s",
            config.model_name,
            dtype,
            self.zero_stage,
            self.gas,
            self.lr,
            self.knobs.zorro_train_enable,
            self.torch_compile,
        )

    # ------------------------------------------------------------------ properties

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module.model

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def global_step(self) -> int:
        return int(self.engine.global_steps)

    def _zorro(self, batch: ParsedBatch) -> bool:
        return bool(self.knobs.zorro_train_enable or batch.meta.zorro_train_enable)

    def _temperature(self, batch: ParsedBatch) -> float:
        if "temperature" in batch.meta_keys or self.knobs.temperature is None:
            return float(batch.meta.temperature)
        return float(self.knobs.temperature)

    # ------------------------------------------------------------------ compute

    def forward_backward(self, batch: ParsedBatch) -> dict[str, Any]:
        """One micro-batch of fwd+bwd; returns ``{metrics, avg_loss}``."""
        from arctic_rl.server.logprobs import response_logprobs
        from arctic_rl.server.losses import compute_loss

        if self.pending >= self.gas:
            raise BadRequest(
                f"gradient_accumulation_steps is {self.gas} and {self.pending} forward-backward call(s) are already "
                f"accumulated: call /step before forward-backward call {self.pending + 1}",
                field="ds_config.gradient_accumulation_steps",
                allowed=self.gas,
                received=self.pending + 1,
            )
        cfg = batch.loss_config
        if cfg is None or batch.loss_name is None:
            raise RuntimeError("forward_backward needs a batch parsed with train=True")
        zorro, temperature = self._zorro(batch), self._temperature(batch)
        want_entropy = batch.wants_entropy or cfg.entropy_coeff != 0.0
        rl = {k: v.to(self.device) for k, v in batch.rl.items()}
        ids, mask, pos = (t.to(self.device) for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
        t0 = time.perf_counter()

        def run(model: torch.nn.Module):
            out = response_logprobs(
                model,
                ids,
                mask,
                pos,
                batch.prompt_len,
                temperature=temperature,
                calculate_entropy=want_entropy,
                zorro=zorro,
            )
            loss, metrics = compute_loss(batch.loss_name, out, rl, cfg)
            return loss, _Carry((out, metrics))

        self.engine.train()
        loss, carry = self.engine(run)
        out, metrics = carry.value
        if not bool(torch.isfinite(loss.detach())):
            raise BadRequest(
                f"loss is not finite ({float(loss.detach())}); the micro-batch was not applied",
                field="loss",
                received=float(loss.detach()),
            )
        # DeepSpeed divides every micro-batch loss by GAS (the mean over micro-batches). With
        # loss_scale_tokens the loss is already this micro-batch's share of the step's sum: undo it.
        # (Multiplying here rather than passing scale_wrt_gas=False: with the forward run through
        # the engine, DeepSpeed's output hooks would still divide.)
        self.engine.backward(loss * self.gas if cfg.loss_scale_tokens is not None else loss)
        self.pending += 1
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(
            tokens_computed=float(out.tokens_computed),
            unique_prompts=float(out.unique_prompts),
            num_rows=float(batch.rows),
            lr=self.lr,
            micro_step=float(self.pending),
            gradient_accumulation_steps=float(self.gas),
            seconds=time.perf_counter() - t0,
        )
        return {"metrics": metrics, "avg_loss": metrics.get("loss")}

    def _param_grad_norm(self) -> float | None:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def step(self, learning_rate: float | None = None) -> dict[str, Any]:
        """The optimizer step after exactly GAS forward-backward calls."""
        if self.pending != self.gas:
            raise BadRequest(
                f"/step after {self.pending} forward-backward call(s), but gradient_accumulation_steps is {self.gas}",
                field="ds_config.gradient_accumulation_steps",
                allowed=self.gas,
                received=self.pending,
            )
        if learning_rate is not None:
            logger.info("step: learning_rate=%s ignored (the DeepSpeed scheduler decides the LR)", learning_rate)
        pre_norm = self._param_grad_norm() if self.zero_stage == 0 else None
        self.engine.step()
        self.pending = 0
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = pre_norm
        return {
            "metrics": {
                "last_lr": self.lr,
                "grad_norm": float(norm) if norm is not None else None,
                "global_step": self.global_step,
            },
            "batch": {},
        }

    def forward(self, batch: ParsedBatch) -> tuple[dict, dict, LogprobAlignment]:
        self.engine.eval()
        try:
            return forward_logprobs(
                self.model,
                batch,
                zorro=self._zorro(batch),
                temperature=self._temperature(batch),
                max_token_len=batch.meta.max_token_len_per_gpu or self.knobs.max_token_len,
            )
        finally:
            self.engine.train()

    # ------------------------------------------------------------------ state

    def weights(self) -> dict[str, torch.Tensor]:
        """The live parameters and buffers by Hugging Face name (no copy)."""
        return self.model.state_dict()

    def save(self, ckpt: Path, *, export_hf: bool) -> dict[str, Any]:
        """Write model + optimizer + scheduler + step + RNG to ``ckpt`` (``.../checkpoint-<step>``)."""
        if self.pending:
            logger.warning("save: %d accumulated micro-batch gradient(s) are not part of a checkpoint", self.pending)
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(ckpt.parent), tag=ckpt.name, save_latest=False)
        ckpt_layout.save_rng_state(ckpt)
        ckpt_layout.write_marker(
            ckpt, {"global_step": self.global_step, "model_name": self.config.model_name, "zero_stage": self.zero_stage}
        )
        hf_path = None
        if export_hf:
            hf_dir = ckpt / "hf"
            self.model.save_pretrained(str(hf_dir), safe_serialization=True)
            load_tokenizer(self.tokenizer_source).save_pretrained(str(hf_dir))
            hf_path = str(hf_dir)
        return {"path": str(ckpt), "hf_path": hf_path, "global_step": self.global_step}

    def load(self, ckpt: Path) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; the next step is the one the saved run would have taken."""
        if self.pending:
            logger.warning("load: discarding %d accumulated micro-batch gradient(s)", self.pending)
            self.engine.zero_grad()
            if hasattr(self.engine.optimizer, "zero_grad"):
                self.engine.optimizer.zero_grad()
            self.pending = 0
        path, _ = self.engine.load_checkpoint(
            str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise BadRequest(f"path: DeepSpeed found no checkpoint at {ckpt}", field="path", received=str(ckpt))
        ckpt_layout.load_rng_state(ckpt)
        return {"path": str(ckpt), "global_step": self.global_step}

    def info(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "pending_micro_batches": self.pending,
            "gradient_accumulation_steps": self.gas,
            "zero_stage": self.zero_stage,
            "lr": self.lr,
            "zorro_train_enable": self.knobs.zorro_train_enable,
            "torch_compile": self.torch_compile,
            "device": str(self.device),
        }

    def close(self) -> None:
        self.engine.destroy() if hasattr(self.engine, "destroy") else None
        del self.engine
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
