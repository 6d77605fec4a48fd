"""FastAPI routes of the reference Arctic RL server: v2 paths, plus the v1 ones (the vendor's
control routes -- sleep/wake, prefix cache, ``/operation``, ... -- are added by :mod:`.control`).

Each route reads its body (size-capped, :mod:`.bodies`), decodes it in the encoding of its wire
generation -- DSSST1 for v2 tensor bodies, ``torch.save`` through the safe loader for v1, JSON
for control calls and v1 ``/generate`` -- hands it to :class:`~.service.ServerState`, and
encodes the answer the same way. Mutating calls go through the idempotency cache
(``X-Request-Id``). Nothing else happens here.

``create_app(settings)`` builds the app; ``python -m arctic_rl.server`` serves it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

import arctic_rl
from arctic_rl.protocol import (
    REPLAY_HEADER,
    REQUEST_ID_HEADER,
    STEP_HEADER,
    DestroyRequest,
    JobConfig,
    LoadCheckpointRequest,
    Paths,
    SaveRequest,
    StepRequest,
    V1SyncWeightsRequest,
    WeightSyncRequest,
)
from arctic_rl.server.errors import install_error_handlers
from arctic_rl.server.http import bodies
from arctic_rl.server.http.auth import BearerTokenMiddleware
from arctic_rl.server.http.control import install_control_routes
from arctic_rl.server.http.idempotency import CachedResponse, payload_hash
from arctic_rl.server.jobs.service import SERVER_NAME, ServerState
from arctic_rl.server.memory_probe import MemoryProbe, MemoryProbeMiddleware
from arctic_rl.server.settings import ServerSettings
from arctic_rl.server_timing import ServerTimingMiddleware

__all__ = ["create_app"]

logger = logging.getLogger("arctic_rl.server")


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """The reference server's ASGI app (``app.state.server`` is its :class:`ServerState`)."""
    settings = settings or ServerSettings()
    state = ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await state.setups.cancel()  # a warm-up still running (its thread ends with the process)
        state.shutdown()

    app = FastAPI(title=SERVER_NAME, version=arctic_rl.__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    if settings.token:
        app.add_middleware(BearerTokenMiddleware, token=settings.token)
    if settings.memory_probe is not None and settings.device == "cuda":
        probe = MemoryProbe(settings.memory_probe)
        if probe.start():  # before any job builds an engine: every allocation's stack is recorded
            app.add_middleware(MemoryProbeMiddleware, probe=probe)
    app.add_middleware(ServerTimingMiddleware)  # outermost: a refused call's answer carries it too
    limit = settings.max_body_bytes
    body_timeout = settings.body_timeout_s

    async def idempotent(
        request: Request, scope: str, body: bytes | bytearray, handler: Callable[[], Awaitable[Response]]
    ) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request.headers.get(STEP_HEADER):
            logger.debug("%s %s=%s", request.url.path, STEP_HEADER, request.headers[STEP_HEADER])
        digest = (
            payload_hash(request.method, request.url.path, request.query_params.multi_items(), body)
            if request_id
            else ""
        )

        async def compute() -> CachedResponse:
            response = await handler()
            return CachedResponse(
                response.status_code, response.body, response.media_type or "application/octet-stream"
            )

        cached, replayed = await state.idempotency.run(scope, request_id, digest, compute)
        if replayed:
            logger.info("%s: replayed X-Request-Id %s from the cache", request.url.path, request_id)
        headers = {REPLAY_HEADER: "true"} if replayed else None
        return Response(
            content=cached.body, status_code=cached.status_code, media_type=cached.media_type, headers=headers
        )

    # ---------------------------------------------------------------- control plane

    @app.get(Paths.HEALTH)
    async def health() -> dict:
        return state.health()

    @app.get(Paths.STATUS)
    async def status() -> dict:
        return state.status()

    @app.get(Paths.JOB)
    async def job(job_id: int) -> dict:
        return state.job_info(job_id)

    @app.post(Paths.INITIALIZE)
    async def initialize(request: Request) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            config = bodies.decode_model(body, JobConfig, required=True)
            return bodies.json_response(await state.initialize(config))

        return await idempotent(request, "server", body, handler)

    @app.post(Paths.DESTROY)
    async def destroy(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            req = bodies.decode_model(body, DestroyRequest) if body.strip() else None
            return bodies.json_response(await state.destroy(job_id, req))

        return await idempotent(request, "server", body, handler)

    # ---------------------------------------------------------------- training (v2 and v1)

    @app.post(Paths.FORWARD_BACKWARD)
    async def forward_backward(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            return bodies.dssst1_response(await state.forward_backward(job_id, bodies.decode_dssst1(body)))

        return await idempotent(request, f"job:{job_id}", body, handler)

    @app.post(Paths.V1_FWD_BWD)
    async def v1_fwd_bwd(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            return bodies.v1_response(await state.forward_backward(job_id, bodies.decode_v1(body)))

        return await idempotent(request, f"job:{job_id}", body, handler)

    @app.post(Paths.FORWARD)
    async def forward(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)
        return bodies.dssst1_response(await state.forward(job_id, bodies.decode_dssst1(body)))

    @app.post(Paths.V1_FWD_NO_GRAD)
    async def v1_fwd_no_grad(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)
        return bodies.v1_response(await state.forward(job_id, bodies.decode_v1(body)))

    @app.post(Paths.STEP)
    async def step(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            return bodies.json_response(await state.step(job_id, bodies.decode_model(body, StepRequest)))

        return await idempotent(request, f"job:{job_id}", body, handler)

    # ---------------------------------------------------------------- checkpoints

    async def _save(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            return bodies.json_response(await state.save(job_id, bodies.decode_model(body, SaveRequest)))

        return await idempotent(request, f"job:{job_id}", body, handler)

    app.add_api_route(Paths.SAVE, _save, methods=["POST"], name="save")
    app.add_api_route(Paths.V1_SAVE_CHECKPOINT, _save, methods=["POST"], name="save_checkpoint_v1")

    @app.post(Paths.LOAD_CHECKPOINT)
    async def load_checkpoint(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            req = bodies.decode_model(body, LoadCheckpointRequest)
            return bodies.json_response(await state.load_checkpoint(job_id, req))

        return await idempotent(request, f"job:{job_id}", body, handler)

    # ---------------------------------------------------------------- weight sync and generation

    @app.post(Paths.WEIGHT_SYNC)
    async def weight_sync(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            req = bodies.decode_model(body, WeightSyncRequest, required=True)
            return bodies.json_response(await state.weight_sync(job_id, req))

        return await idempotent(request, f"job:{job_id}", body, handler)

    @app.post(Paths.V1_SYNC_WEIGHTS)
    async def v1_sync_weights(request: Request) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)

        async def handler() -> Response:
            v1 = bodies.decode_model(body, V1SyncWeightsRequest, required=True)
            req = WeightSyncRequest(source_sub_job_id=v1.training_job_id, target_sub_job_ids=[v1.sampling_job_id])
            return bodies.json_response(await state.weight_sync(None, req))

        return await idempotent(request, "server", body, handler)

    @app.post(Paths.GENERATE)
    async def generate(request: Request, job_id: int) -> Response:
        body = await bodies.read_body(request, limit, body_timeout)
        if bodies.is_json(request):  # v1: JSON in, JSON out
            return bodies.json_response(await state.generate(job_id, bodies.decode_json(body)))
        return bodies.dssst1_response(await state.generate(job_id, bodies.decode_dssst1(body)))

    install_control_routes(app, state, limit=limit, body_timeout=body_timeout)
    return app
