"""The log_prob engine: a forward-only copy of the model (the reference policy for KL).

It keeps the weights it was initialised with unless a ``/weight-sync`` names it as a target.
``forward`` is the same no-grad computation as the training engine's
(:func:`~arctic_rl.server.engines.common.forward_logprobs`); ``text_logprobs`` answers the vendor's
``/log-probs`` on raw texts. No optimizer. With ``ds_config.zero_optimization.stage`` 3 the model is wrapped in
an inference-only DeepSpeed engine, as the training engine builds its own (:mod:`.ds_glue`): ZeRO-3 partitions
the parameters and gathers each layer's for its forward, and ``offload_param`` to ``cpu`` keeps the partitions
on the host (the memory report lists them under ``offloaded`` on a GPU); below stage 3 the job holds a plain
copy (:func:`~.config.build_inference_ds_config`; what it cannot run is a 400 at job creation).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from arctic_rl.protocol import JobConfig, JobType, LogprobAlignment
from arctic_rl.server.engines.batch import ParsedBatch
from arctic_rl.server.engines.common import (
    compute_dtype,
    ensure_process_group,
    forward_logprobs,
    load_model,
    load_tokenizer,
    model_vocab_size,
    resolve_device,
)
from arctic_rl.server.engines.config import build_inference_ds_config, parse_worker_knobs
from arctic_rl.server.engines.ds_glue import PolicyModule, import_deepspeed
from arctic_rl.server.engines.weights import copy_weights
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.memory import JobMemory, job_memory
from arctic_rl.server.settings import ServerSettings
from arctic_rl.server.zorro.planner import ZorroPlanner

__all__ = ["LogProbEngine"]

logger = logging.getLogger("arctic_rl.server")


class LogProbEngine:
    job_type = JobType.LOG_PROB

    def __init__(self, config: JobConfig, settings: ServerSettings, job_dir: Path | None = None) -> None:
        self.config = config
        self.device = resolve_device(settings.device)
        self.memory = JobMemory(self.device)
        self.zorro_planner = ZorroPlanner("log_prob", "/forward", min_saving=settings.zorro_min_saving,
                                          trials=settings.zorro_trials)
        self.knobs, _, unknown = parse_worker_knobs(config.ds_worker_config)
        if unknown:
            logger.info("log_prob job: unknown ds_worker_config keys ignored: %s", unknown)
        self.dtype = compute_dtype(self.device)
        # checked before the model loads: what cannot run is a 400 at job creation
        self.ds_config, notes = build_inference_ds_config(config.ds_config, bf16=self.dtype == torch.bfloat16)
        for note in notes:
            logger.info("log_prob job: %s", note)
        model = load_model(
            config.model_name, device=self.device, dtype=self.dtype, attn_implementation=self.knobs.attn_implementation
        )
        model.eval()
        model.requires_grad_(False)
        self.vocab_size = model_vocab_size(model)  # before ZeRO-3 empties the parameters
        self.engine: Any = None
        if self.ds_config is not None:
            deepspeed = import_deepspeed(self.device)
            ensure_process_group(self.device)
            self.engine, _, _, _ = deepspeed.initialize(model=PolicyModule(model), config=self.ds_config)
            self.engine.eval()
            model = self.engine.module.model
        self.model = model
        self.zero_stage = 3 if self.ds_config is not None else 0
        offload = (self.ds_config or {}).get("zero_optimization", {}).get("offload_param")
        self.weights_on = "cpu" if offload else str(self.device)
        logger.info("log_prob job ready: %s, %s, ZeRO-%d, weights on %s", config.model_name, self.dtype,
                    self.zero_stage, self.weights_on)
        self.weight_version = 0

    def forward(self, batch: ParsedBatch) -> tuple[dict, dict, LogprobAlignment]:
        job_t = self.knobs.temperature if self.knobs.zorro_train_enable else None
        with self.memory.tracking():
            return forward_logprobs(
                self.model,
                batch,
                zorro=bool(self.knobs.zorro_train_enable or batch.meta.zorro_train_enable),
                temperature=batch.scoring_temperature(job_t),
                max_token_len=batch.meta.max_token_len_per_gpu or self.knobs.max_token_len,
                planner=self.zorro_planner,
            )

    @functools.cached_property
    def text_tokenizer(self) -> Any:
        """The model's tokenizer padding on the right, for :meth:`text_logprobs` (built on first use)."""
        tokenizer = load_tokenizer(self.config.model_name)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        return tokenizer

    def text_logprobs(self, texts: list[str]) -> torch.Tensor:
        """``/log-probs``: per-token ``log p(token c+1 | <= c)`` of each text, ``[B, S-1]`` (rows right-padded,
        padding 0)."""
        enc = self.text_tokenizer(texts, return_tensors="pt", padding=True)
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        if ids.shape[1] < 2:
            raise BadRequest("prompts: every text must have at least two tokens", field="prompts",
                             received=int(ids.shape[1]))
        context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        if context and ids.shape[1] > context:
            raise BadRequest(f"prompts: {ids.shape[1]} tokens exceed the model's context of {context}",
                             field="prompts", allowed=context, received=int(ids.shape[1]))
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return (lp * mask[:, 1:]).cpu()

    def memory_report(self) -> dict[str, int]:
        """Bytes by part (:mod:`arctic_rl.server.memory`): the weights (under ZeRO-3 this process's partitions;
        on a GPU, those held on the host also under ``offloaded``) and the passes' buffers."""
        return self.memory.report(self.model)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> int:
        copy_weights(self.model, weights, partitioned=self.zero_stage == 3)
        self.weight_version += 1
        return self.weight_version

    def info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "device": str(self.device), "dtype": str(self.dtype),
                "zero_stage": self.zero_stage, "weights_on": self.weights_on, "memory": job_memory(self),
                "warm_up_s": getattr(self, "warm_up_s", None)}  # set by arctic_rl.server.engines.warmup

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = None
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
