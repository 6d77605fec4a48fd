"""The vendor's v2 control routes on the reference server: sleep/wake, prefix cache, ``/operation``,
``/weight-norm``, ``/empty-training-cache`` and ``/log-probs``.

They exist so that a client written for the vendor's server (Arctic-Platform ``common/http_server.py``)
-- its own verl integration included -- runs against this one unchanged. Request and answer shapes
are the vendor's; what each does here:

==========================  =================================================================================
route                       here
==========================  =================================================================================
``/sleep-inference``        ``?job_id=<sampling>``, level from the query or ``{level}``: the sampler's ``sleep``;
                            passes that arrive meanwhile wait for it (:mod:`arctic_rl.server.jobs.sleep_gate`)
``/wake-inference``         body a tag list, ``{tags}`` or nothing (= all): the sampler's ``wake_up``
``/reset-prefix-cache``     :class:`~arctic_rl.protocol.ResetPrefixCacheRequest`: the sampler's ``reset_prefix_cache``
``/operation``              :class:`~arctic_rl.protocol.OperationRequest`: one of the four above / weight sync
``/sleep-training``         ``mode`` all / non_lp / lp_params; ``/wake-training``, ``/sleep-log-prob``,
                            ``/wake-log-prob``: the state stays resident (one process, no GPU time-sharing
                            with a colocated sampler), answered ``{job_id, workers: [status]}``
``/empty-training-cache``   ``gc.collect`` and, on CUDA, ``torch.cuda.empty_cache``
``/weight-norm``            L2 norms of the training and sampling models (equal after a weight sync)
``/log-probs``              JSON ``{prompts, completions?, top_k}`` -> DSSST1 ``{job_id, results [B, S-1]}``
==========================  =================================================================================

Unknown jobs are 404, jobs of the wrong type 400 (as at the vendor). What is not here: training,
generation or the weight copy itself (:mod:`arctic_rl.server.jobs.service`, :mod:`arctic_rl.server.engines`).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from arctic_rl.protocol import (
    JobType,
    LogProbsRequest,
    OperationRequest,
    OperationType,
    Paths,
    ResetPrefixCacheRequest,
    WeightNormRequest,
    WeightSyncRequest,
)
from arctic_rl.server.engines.protocols import BaseEngine
from arctic_rl.server.engines.weights import weight_norm
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.http import bodies
from arctic_rl.server.jobs.service import ServerState

__all__ = ["SLEEP_TRAINING_MODES", "install_control_routes"]

SLEEP_TRAINING_MODES = ("all", "non_lp", "lp_params")

logger = logging.getLogger("arctic_rl.server")


def _state_of(engine: BaseEngine, *, sleeping: bool, mode: str | None = None) -> dict[str, Any]:
    device = str(engine.device)
    status = {"status": "resident" if sleeping else "on_device", "device": device}
    if mode is not None:
        status["mode"] = mode
    return status


def _empty_cache(engine: BaseEngine) -> dict[str, Any]:
    gc.collect()
    gpu_mb = 0.0
    if str(engine.device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
        gpu_mb = torch.cuda.memory_allocated() / 1e6
    return {"gpu_mb": gpu_mb}


class ControlService:
    """What the control routes do, on top of :class:`~arctic_rl.server.jobs.service.ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def sleep_inference(self, job_id: int, level: int) -> dict[str, Any]:
        job = self.state.jobs.get(job_id, JobType.SAMPLING)
        with self.state.sleep_gate.sleeping():  # the passes that arrive meanwhile wait for it (.jobs.sleep_gate)
            out = await self.state.run_on_job(job, job.engine.sleep, level)
        logger.info("sleep-inference job=%d level=%d", job_id, level)
        return {"job_id": job_id, "sampling": out}

    async def wake_inference(self, job_id: int, tags: list[str] | None) -> dict[str, Any]:
        job = self.state.jobs.get(job_id, JobType.SAMPLING)
        out = await self.state.run_on_job(job, job.engine.wake_up, tags)
        logger.info("wake-inference job=%d tags=%s", job_id, "all" if tags is None else ",".join(tags))
        return {"job_id": job_id, "sampling": out}

    async def reset_prefix_cache(self, job_id: int, request: ResetPrefixCacheRequest) -> dict[str, Any]:
        job = self.state.jobs.get(job_id, JobType.SAMPLING)
        return {"job_id": job_id, "sampling": await self.state.run_on_job(job, job.engine.reset_prefix_cache)}

    async def operation(self, job_id: int, request: OperationRequest) -> dict[str, Any]:
        kind, payload = request.operation_type, request.payload or {}
        allowed = [t.value for t in OperationType]
        if kind == OperationType.WEIGHT_SYNC:
            return await self.state.weight_sync(job_id, _model(WeightSyncRequest, payload, "payload"))
        if kind == OperationType.RESET_PREFIX_CACHE:
            return await self.reset_prefix_cache(job_id, _model(ResetPrefixCacheRequest, payload, "payload"))
        if kind == OperationType.SLEEP_INFERENCE:
            return await self.sleep_inference(job_id, _level(payload.get("level", 1)))
        if kind == OperationType.WAKE_INFERENCE:
            return await self.wake_inference(job_id, _tags(payload.get("tags")))
        raise BadRequest(f"operation_type: unknown operation {kind!r}", field="operation_type", allowed=allowed,
                         received=kind)

    async def sleep_job(self, job_id: int, job_type: JobType, mode: str | None = None) -> dict[str, Any]:
        job = self.state.jobs.get(job_id, job_type)
        return {"job_id": job_id, "workers": [_state_of(job.engine, sleeping=True, mode=mode)]}

    async def wake_job(self, job_id: int, job_type: JobType) -> dict[str, Any]:
        job = self.state.jobs.get(job_id, job_type)
        return {"job_id": job_id, "workers": [_state_of(job.engine, sleeping=False)]}

    async def empty_training_cache(self, job_id: int) -> dict[str, Any]:
        job = self.state.jobs.get(job_id, JobType.TRAINING)
        return {"job_id": job_id, "workers": [await self.state.run_on_job(job, _empty_cache, job.engine)]}

    async def weight_norm(self, request: WeightNormRequest) -> dict[str, Any]:
        training = self.state.jobs.get(request.training_job_id, JobType.TRAINING)
        sampling = self.state.jobs.get(request.sampling_job_id, JobType.SAMPLING)
        t = await self.state.run_on_job(training, weight_norm, training.engine.model)
        s = await self.state.run_on_job(sampling, sampling.engine.weight_norm)  # vLLM's lives in its worker
        return {"training_norm": t["norm"], "sampling_norm": s["norm"], "training_num_params": t["num_params"],
                "sampling_num_params": s["num_params"]}

    async def log_probs(self, job_id: int, request: LogProbsRequest) -> dict[str, Any]:
        job = self.state.jobs.get(job_id, JobType.LOG_PROB)
        texts = list(request.prompts)
        if request.completions is not None:
            if len(request.completions) != len(texts):
                raise BadRequest("completions: expected one per prompt", field="completions", allowed=len(texts),
                                 received=len(request.completions))
            texts = [p + c for p, c in zip(texts, request.completions)]
        return {"job_id": job_id, "results": await self.state.run_on_job(job, job.engine.text_logprobs, texts)}


def _model(model, payload: dict, prefix: str):
    from pydantic import ValidationError

    from arctic_rl.server.errors import from_validation_error

    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix=prefix) from None


def _level(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise BadRequest("level: expected an integer", field="level", allowed=[1, 2], received=value)
    return int(value)


def _tags(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise BadRequest("tags: expected a list of strings", field="tags", allowed=["weights", "kv_cache"],
                         received=value)
    return value


def install_control_routes(app: FastAPI, state: ServerState, *, limit: int, body_timeout: float | None) -> None:
    """Add the vendor's control routes (the module docstring) to ``app``."""
    control = ControlService(state)

    async def json_body(request: Request) -> Any:
        return bodies.decode_json(await bodies.read_body(request, limit, body_timeout), required=False)

    def field(body: Any, key: str) -> Any:
        return body.get(key) if isinstance(body, dict) else None

    @app.post(Paths.SLEEP_INFERENCE)
    async def sleep_inference(request: Request, job_id: int, level: int = 1) -> Response:
        body = await json_body(request)
        if field(body, "level") is not None:
            level = _level(body["level"])
        return bodies.json_response(await control.sleep_inference(job_id, level))

    @app.post(Paths.WAKE_INFERENCE)
    async def wake_inference(request: Request, job_id: int) -> Response:
        body = await json_body(request)
        tags = body.get("tags") if isinstance(body, dict) else body
        return bodies.json_response(await control.wake_inference(job_id, _tags(tags)))

    @app.post(Paths.RESET_PREFIX_CACHE)
    async def reset_prefix_cache(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)
        req = bodies.decode_model(body, ResetPrefixCacheRequest)
        return bodies.json_response(await control.reset_prefix_cache(job_id, req))

    @app.post(Paths.OPERATION)
    async def operation(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)
        req = bodies.decode_model(body, OperationRequest, required=True)
        return bodies.json_response(await control.operation(job_id, req))

    @app.post(Paths.SLEEP_TRAINING)
    async def sleep_training(request: Request, job_id: int, mode: str = "all") -> Response:
        body = await json_body(request)
        if field(body, "mode") is not None:
            mode = str(body["mode"])
        if mode not in SLEEP_TRAINING_MODES:
            raise BadRequest("mode: unknown sleep mode", field="mode", allowed=list(SLEEP_TRAINING_MODES),
                             received=mode)
        return bodies.json_response(await control.sleep_job(job_id, JobType.TRAINING, mode))

    @app.post(Paths.WAKE_TRAINING)
    async def wake_training(request: Request, job_id: int) -> Response:
        await json_body(request)
        return bodies.json_response(await control.wake_job(job_id, JobType.TRAINING))

    @app.post(Paths.SLEEP_LOG_PROB)
    async def sleep_log_prob(request: Request, job_id: int) -> Response:
        await json_body(request)
        return bodies.json_response(await control.sleep_job(job_id, JobType.LOG_PROB))

    @app.post(Paths.WAKE_LOG_PROB)
    async def wake_log_prob(request: Request, job_id: int) -> Response:
        await json_body(request)
        return bodies.json_response(await control.wake_job(job_id, JobType.LOG_PROB))

    @app.post(Paths.EMPTY_TRAINING_CACHE)
    async def empty_training_cache(request: Request, job_id: int) -> Response:
        await json_body(request)
        return bodies.json_response(await control.empty_training_cache(job_id))

    @app.post(Paths.WEIGHT_NORM)
    async def weight_norm_route(request: Request) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)
        return bodies.json_response(await control.weight_norm(bodies.decode_model(body, WeightNormRequest,
                                                                                  required=True)))

    @app.post(Paths.LOG_PROBS)
    async def log_probs(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)
        req = bodies.decode_model(body, LogProbsRequest, required=True)
        return bodies.dssst1_response(await control.log_probs(job_id, req))
