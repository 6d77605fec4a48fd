"""The training engine: a DeepSpeed engine over a Hugging Face causal LM (one process).

* ``forward_backward`` -- one mini-batch, as at the vendor's worker: its rows are split into
  ``gradient_accumulation_steps`` (GAS) micro-batches, each runs log-probs
  (:func:`~arctic_rl.server.compute.token_logprobs.response_logprobs`, ZoRRO when enabled), the allow-listed loss
  (:func:`~arctic_rl.server.compute.losses.compute_loss`) and ``engine.backward``. The forward runs *through*
  the DeepSpeed engine (the model is wrapped in :class:`~.ds_glue.PolicyModule`, whose forward takes the whole
  computation as a function), so DeepSpeed's backward hooks see it exactly as with ``engine(batch)``.
  ``token-mean`` divides by the mini-batch's tokens (``meta.batch_num_tokens``), so the gradient is
  that of ``sum(loss * mask) / batch_num_tokens`` over the whole mini-batch. When the call takes
  ZoRRO's pass, consecutive micro-batches share one model pass while it computes no more tokens than
  one plain micro-batch (:mod:`arctic_rl.server.zorro.passes`); the loss is still each micro-batch's, summed.
* ``step`` -- the optimizer step closing the mini-batch (DeepSpeed runs with
  ``managed_gradient_accumulation=false``; this engine is the accumulation boundary). A second
  ``forward_backward`` before ``step``, or a ``step`` without one, is a 400. ``global_step`` counts
  ``/step`` calls, as the vendor's engine does for the same call sequence.
* ``forward`` -- no-grad log-probs (eval mode); ``weights`` -- the parameters by name, for weight sync;
  ``memory_report`` -- its memory by part (:mod:`arctic_rl.server.memory`).

What is not here: checkpoints (:mod:`.training_state`), DeepSpeed's wrapping (:mod:`.ds_glue`), HTTP.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from arctic_rl.protocol import JobConfig, JobType, LogprobAlignment
from arctic_rl.server.compute.token_logprobs import set_compiled_token_stats
from arctic_rl.server.engines.batch import ParsedBatch
from arctic_rl.server.engines.common import (
    compile_model,
    ensure_process_group,
    forward_logprobs,
    load_model,
    model_vocab_size,
    resolve_compile_mode,
    resolve_device,
)
from arctic_rl.server.engines.config import build_training_ds_config, parse_worker_knobs
from arctic_rl.server.engines.ds_glue import Carry, PolicyModule, gathered_state_dict, import_deepspeed
from arctic_rl.server.engines.micro_metrics import combine_micro_metrics
from arctic_rl.server.engines.training_state import load_training, save_training
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.memory import JobMemory, job_memory
from arctic_rl.server.settings import ServerSettings
from arctic_rl.server.zorro.flex import set_response_attention
from arctic_rl.server.zorro.passes import merge_micro_batches
from arctic_rl.server.zorro.planner import ZorroPlan, ZorroPlanner
from arctic_rl.server.zorro.rule import ZorroChoiceLog, row_slices

__all__ = ["TrainingEngine"]

logger = logging.getLogger("arctic_rl.server")
_import_deepspeed = import_deepspeed  # the name benchmarks/grpo_bare.py imports


class TrainingEngine:
    """One DeepSpeed training engine (see the module docstring)."""

    job_type = JobType.TRAINING

    def __init__(self, config: JobConfig, settings: ServerSettings, job_dir: Path) -> None:
        self.config = config
        self.job_dir = job_dir
        self.device = resolve_device(settings.device)
        self.memory = JobMemory(self.device)
        choices = ZorroChoiceLog("training")
        self.zorro_planners = {call: ZorroPlanner("training", call, min_saving=settings.zorro_min_saving,
                                                  trials=settings.zorro_trials, choices=choices)
                               for call in ("/forward", "/forward-backward")}
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

        deepspeed = import_deepspeed(self.device)
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
        wrapper = PolicyModule(model)
        params = [p for p in wrapper.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=wrapper, model_parameters=params, config=self.ds_config)
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        compile_mode = settings.torch_compile if self.zero_stage < 3 else "off"  # ZeRO-3: hooks gather each layer
        self.torch_compile = resolve_compile_mode(compile_mode, self.device)
        compile_model(self.model, self.torch_compile)  # after DeepSpeed wrapped it
        # where torch.compile works on a GPU, ZoRRO's response pass uses compiled FlexAttention (no prompt copies)
        set_response_attention("flex" if self.device.type == "cuda" and self.torch_compile != "off" else "expand")
        set_compiled_token_stats(self.torch_compile != "off")  # fused log-softmax / entropy chunks
        self.gas = int(self.engine.gradient_accumulation_steps())
        self.pending = 0  # 1 after a /forward-backward until the /step that closes it
        self.warm_up_s: float | None = None  # seconds of the warm-up at creation (arctic_rl.server.engines.warmup)
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
        """The vendor's rule (:meth:`ParsedBatch.scoring_temperature`): a ZoRRO job's own temperature, else
        ``meta.temperature`` under the ``apply_temperature`` post-processor, else 1."""
        job_t = self.knobs.temperature if self.knobs.zorro_train_enable else None
        return batch.scoring_temperature(job_t)

    # ------------------------------------------------------------------ compute

    def memory_report(self) -> dict[str, int]:
        """Bytes by part (:mod:`arctic_rl.server.memory`): model, gradients, optimizer, the passes' buffers."""
        return self.memory.report(self.model, self.engine.optimizer)

    def forward_backward(self, batch: ParsedBatch) -> dict[str, Any]:
        with self.memory.tracking():
            return self._forward_backward(batch)

    def _forward_backward(self, batch: ParsedBatch) -> dict[str, Any]:
        """One mini-batch of fwd+bwd, split into GAS micro-batches; returns ``{metrics, avg_loss}``.

        As at the vendor's worker: the call's rows are split into ``gradient_accumulation_steps``
        contiguous micro-batches, each is run forward and backward, and ``/step`` closes the
        accumulation. ``token-mean`` divides by the mini-batch's token count: ``meta.batch_num_tokens``
        (where the vendor reads it), else ``processing.config.loss_scale_tokens``, else the call's own
        response tokens. The metrics are the call's token means (never sums over micro-batches).
        """
        from arctic_rl.server.compute.losses import compute_loss
        from arctic_rl.server.compute.token_logprobs import response_logprobs

        if self.pending:
            raise BadRequest(
                "one /forward-backward per mini-batch: the previous one is not closed by /step yet "
                f"(the server splits each call into its gradient_accumulation_steps={self.gas} micro-batches)",
                field="ds_config.gradient_accumulation_steps",
                allowed="/step before the next /forward-backward",
                received="a second /forward-backward",
            )
        cfg = batch.loss_config
        if cfg is None or batch.loss_name is None:
            raise RuntimeError("forward_backward needs a batch parsed with train=True")
        if batch.rows % self.gas:
            raise BadRequest(
                f"batch: {batch.rows} rows do not split into gradient_accumulation_steps={self.gas} "
                "equal micro-batches",
                field="batch.input_ids",
                allowed=f"a multiple of {self.gas} rows",
                received=batch.rows,
            )
        token_mean = cfg.loss_agg_mode == "token-mean"
        mask_key = "response_mask" if "response_mask" in batch.rl else "loss_mask"
        call_tokens = float(batch.rl[mask_key].sum())
        if token_mean:
            denom = batch.meta.batch_num_tokens or cfg.loss_scale_tokens or max(call_tokens, 1.0)
            cfg = cfg.model_copy(update={"loss_scale_tokens": float(denom)})
        temperature = self._temperature(batch)
        want_entropy = batch.wants_entropy or cfg.entropy_coeff != 0.0
        rows = batch.rows // self.gas
        micro_batches = row_slices(batch.rows, rows)
        plan = ZorroPlan(passes=[[micro] for micro in micro_batches])  # the plain passes: one per micro-batch
        planner = self.zorro_planners["/forward-backward"]
        if self._zorro(batch):  # the pass: ZoRRO where deduplicating the prompts pays and is timed
            plan = planner.plan(self.model, batch, plan.passes, lambda groups: self._zorro_passes(
                batch, groups, micro_batches))
        passes, zorro = plan.passes, plan.use_zorro
        t0 = time.perf_counter()
        parts: list[tuple[dict[str, float], float]] = []
        tokens_computed = unique_prompts = 0
        self.engine.train()
        for index, group in enumerate(passes):
            start, stop = group[0][0], group[-1][1]
            part = batch.slice_rows(start, stop)
            rl = {k: v.to(self.device) for k, v in part.rl.items()}
            ids, mask, pos = (t.to(self.device) for t in (part.input_ids, part.attention_mask, part.position_ids))
            slices = [(a - start, b - start) for a, b in group]

            def run(model: torch.nn.Module, ids=ids, mask=mask, pos=pos, rl=rl, slices=slices):
                out = response_logprobs(
                    model, ids, mask, pos, batch.prompt_len,
                    temperature=temperature, calculate_entropy=want_entropy, zorro=zorro,
                )
                # the loss of each micro-batch, summed: a merged ZoRRO pass gives the same gradient
                losses, metrics = [], []
                for a, b in slices:
                    sub_rl = {k: v[a:b] for k, v in rl.items()}
                    loss, m = compute_loss(batch.loss_name, out.row_range(a, b), sub_rl, cfg)
                    losses.append(loss)
                    metrics.append((m, sub_rl[mask_key]))
                return torch.stack(losses).sum(), Carry((out, metrics))

            loss, carry = self.engine(run)
            out, micro_metrics = carry.value
            if not bool(torch.isfinite(loss.detach())):
                if index:  # gradients of earlier passes are accumulated: drop them
                    self.discard_gradients()
                raise BadRequest(
                    f"loss is not finite ({float(loss.detach())}); the mini-batch was not applied",
                    field="loss",
                    received=float(loss.detach()),
                )
            # DeepSpeed divides every micro-batch loss by GAS (a mean over micro-batches). A token-mean loss
            # is already this micro-batch's share of the mini-batch's sum: undo the division, as the vendor
            # does with scale_wrt_gas=False. (Multiplying here: with the forward run through the engine,
            # DeepSpeed's output hooks would divide even with scale_wrt_gas=False.)
            self.engine.backward(loss * self.gas if token_mean else loss)
            for m, micro_mask in micro_metrics:
                tokens = float(m.get("num_tokens", micro_mask.sum()))
                parts.append(({k: float(v) for k, v in m.items()}, tokens))
            tokens_computed += out.tokens_computed
            unique_prompts += out.unique_prompts
            del loss, carry, out, micro_metrics  # this pass's outputs go before the next pass's forward
        self.pending = 1
        if plan.rule is not None and plan.rule.use_zorro and planner.timing:
            if self.device.type == "cuda":  # the last backward's kernels belong to this call's time
                torch.cuda.synchronize(self.device)
            planner.record(plan, time.perf_counter() - t0)
        metrics = combine_micro_metrics(parts, token_mean=token_mean, denom=cfg.loss_scale_tokens)
        metrics.update(
            tokens_computed=float(tokens_computed),
            unique_prompts=float(unique_prompts),
            num_rows=float(batch.rows),
            num_tokens=call_tokens,
            lr=self.lr,
            micro_batches=float(self.gas),
            passes=float(len(passes)),
            gradient_accumulation_steps=float(self.gas),
            seconds=time.perf_counter() - t0,
        )
        metrics.update(planner.metrics(plan))
        return {"metrics": metrics, "avg_loss": metrics.get("loss")}

    def _zorro_passes(
        self, batch: ParsedBatch, groups: torch.Tensor, micro_batches: list[tuple[int, int]]
    ) -> list[list[tuple[int, int]]]:
        """The call's micro-batches grouped into ZoRRO passes of at most one plain micro-batch's tokens
        (:mod:`arctic_rl.server.zorro.passes`; ``groups`` is the call's ``row_to_group``)."""
        micro_rows = micro_batches[0][1] - micro_batches[0][0] if micro_batches else 0
        return merge_micro_batches(groups, micro_batches, batch.prompt_len, batch.response_len,
                                   budget=micro_rows * batch.total_len)

    def discard_gradients(self) -> None:
        """Drop the gradients accumulated since the last step (a failed pass, or a checkpoint load)."""
        self.engine.zero_grad()
        if hasattr(self.engine.optimizer, "zero_grad"):
            self.engine.optimizer.zero_grad()
        window = getattr(self.engine.optimizer, "all_grad_tensors", None)  # ZeRO-1/2: the window's gradients
        if isinstance(window, dict):  # (held until the step; zero_grad leaves them)
            window.update(dict.fromkeys(window))

    def _param_grad_norm(self) -> float | None:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def step(self, learning_rate: float | None = None) -> dict[str, Any]:
        """The optimizer step closing the mini-batch of the last ``/forward-backward``."""
        if not self.pending:
            raise BadRequest(
                "/step without a /forward-backward since the last step (one /forward-backward per mini-batch, "
                "then one /step)",
                field="ds_config.gradient_accumulation_steps",
                allowed="/forward-backward before /step",
                received="/step",
            )
        if learning_rate is not None:
            logger.info("step: learning_rate=%s ignored (the DeepSpeed scheduler decides the LR)", learning_rate)
        pre_norm = self._param_grad_norm() if self.zero_stage == 0 else None
        with self.memory.tracking():
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
            with self.memory.tracking():
                return forward_logprobs(
                    self.model,
                    batch,
                    zorro=self._zorro(batch),
                    temperature=self._temperature(batch),
                    max_token_len=batch.meta.max_token_len_per_gpu or self.knobs.max_token_len,
                    planner=self.zorro_planners["/forward"],
                )
        finally:
            self.engine.train()

    # ------------------------------------------------------------------ state

    def weights(self) -> dict[str, torch.Tensor]:
        """The live parameters and buffers by Hugging Face name (no copy); under ZeRO-3, whose parameters are
        partitioned between passes, a gathered copy (the whole model's size, for as long as it is held)."""
        return self.model.state_dict() if self.zero_stage < 3 else gathered_state_dict(self.model)

    def save(self, ckpt: Path, *, export_hf: bool) -> dict[str, Any]:
        """Write model + optimizer + scheduler + step + RNG to ``ckpt`` (``.../checkpoint-<step>``)."""
        return save_training(self, ckpt, export_hf=export_hf)

    def load(self, ckpt: Path) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; the next step is the one the saved run would have taken."""
        return load_training(self, ckpt)

    def info(self) -> dict[str, Any]:
        return {
            "memory": job_memory(self),  # never fails the call (a step may run meanwhile)
            "global_step": self.global_step,
            "pending_forward_backward": self.pending,
            "pending_micro_batches": self.pending * self.gas,
            "gradient_accumulation_steps": self.gas,
            "zero_stage": self.zero_stage,
            "lr": self.lr,
            "zorro_train_enable": self.knobs.zorro_train_enable,
            "torch_compile": self.torch_compile,
            "warm_up_s": self.warm_up_s,
            "device": str(self.device),
        }

    def close(self) -> None:
        self.engine.destroy() if hasattr(self.engine, "destroy") else None
        del self.engine
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
