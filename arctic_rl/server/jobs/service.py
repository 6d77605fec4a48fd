"""What each endpoint does, on top of the job registry (the HTTP layer, :mod:`arctic_rl.server.app`, stays thin).

:class:`ServerState` owns the jobs, the idempotency cache and a small thread pool. Every compute
call takes the job's lock and runs in a worker thread, so the event loop -- and ``/health`` --
stay responsive during training or generation. Inside the thread, ``ValueError``s raised by the
compute modules on bad input (ZoRRO layout, loss arguments) become 400s; anything else is a 500.

Decisions documented here (and in ``docs/SERVER.md``):

* ZoRRO is on for a call when the job's ``ds_worker_config.zorro_train_enable`` or the call's
  ``meta.zorro_train_enable`` is true; ``/forward`` then answers response-aligned log-probs,
  otherwise shifted ones, and says which in ``logprob_alignment``.
* ``/save``'s ``path`` names a *base* directory (default: the job's directory); the checkpoint is
  written to ``<base>/checkpoint-<step>`` (``step`` defaults to the global step) and
  ``<base>/latest`` points at it.
* ``/weight-sync``'s query ``job_id`` must be its ``source_sub_job_id`` (the training job).
* ``/generate`` on a sampler that batches continuously (both of ours; :mod:`arctic_rl.server.engines.continuous`) takes no job
  lock: calls run side by side in the sampler's running batch, each answered when its own sequences end, with the
  ``weight_version`` it ran on. A weight sync, sleep, wake or prefix-cache reset holds the job lock and runs in the
  engine between two steps: a sync waits for the calls in flight (or, under
  ``--in-flight-on-weight-load restart``, restarts them on the new weights), a sleep waits for them.
* ``/initialize`` answers once the job's engine is built; its warm-up runs after, and the job's calls, the samplers
  and every other job's compute calls wait for it (:mod:`arctic_rl.server.jobs.background_setup`).
* A ``/forward`` or ``/forward-backward`` that arrives while a sampler falls asleep parses its batch, then waits for
  the sleep before its pass (:mod:`arctic_rl.server.jobs.sleep_gate`): no pass runs beside the KV cache it frees.
* Under ``--training-stream on`` the training and log_prob jobs' calls run on a CUDA stream apart from the sampler's,
  and a weight sync waits for the device before it releases its jobs (:mod:`arctic_rl.server.jobs.training_stream`).
* A weight sync hands the caching allocator's unused blocks back to the device after the loads (``--release-at-sync``,
  on by default): in async mode nothing else releases them between steps (:mod:`arctic_rl.server.jobs.weight_sync`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

import arctic_rl
from arctic_rl.protocol import (
    DestroyRequest,
    Features,
    JobConfig,
    JobType,
    LoadCheckpointRequest,
    ProtocolVersion,
    SaveRequest,
    StepRequest,
    WeightSyncRequest,
)
from arctic_rl.server.errors import ApiError, BadRequest, Conflict, from_validation_error
from arctic_rl.server.http.idempotency import IdempotencyCache
from arctic_rl.server.http.validation import parse_batch_body
from arctic_rl.server.jobs import checkpoint as ckpt
from arctic_rl.server.jobs.background_setup import BackgroundSetups, job_setup
from arctic_rl.server.jobs.gc_freeze import freeze_long_lived, thaw
from arctic_rl.server.jobs.registry import Job, JobRegistry
from arctic_rl.server.jobs.sleep_gate import SleepGate
from arctic_rl.server.jobs.training_stream import TrainingStream
from arctic_rl.server.jobs.weight_sync import load_weights_into
from arctic_rl.server.memory import job_memory, memory_metrics
from arctic_rl.server.settings import ServerSettings

__all__ = ["FEATURES", "SERVER_NAME", "ServerState"]

T = TypeVar("T")

logger = logging.getLogger("arctic_rl.server")

SERVER_NAME = "arctic_rl-reference"
FEATURES = (
    Features.TOKEN_PROMPTS, Features.N_SAMPLES, Features.IDEMPOTENCY, Features.LOAD_CHECKPOINT, Features.INSTANCE_ID,
    Features.COMPACT_RESULTS, Features.POLICY_LOSSES, Features.CONTINUOUS_BATCHING, Features.RESPONSE_LOGPROBS,
    Features.CONCURRENT_JOBS, Features.SAMPLER_SLEEP, Features.BATCH_SHAPE,
)


def _with_memory(job: Job) -> dict[str, Any]:
    """``/status``'s view of a job: its info with ``memory`` (bytes by part, :mod:`arctic_rl.server.memory`)."""
    info = job.info()
    if "memory" not in info and job.engine is not None:
        info["memory"] = job_memory(job.engine)
    return info


def _translate_errors(fn, *args):
    """Run ``fn`` (in a worker thread); bad-input ``ValueError``s become 400s."""
    try:
        return fn(*args)
    except ApiError:
        raise
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except ValueError as exc:  # raised by logprobs / zorro / losses on invalid batches
        raise BadRequest(str(exc)) from None


class ServerState:
    """The server's jobs and what every endpoint does with them."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.jobs = JobRegistry()
        self.idempotency = IdempotencyCache(settings.idempotency_capacity)
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.time()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="arctic-job")
        #: the sampler sleeps running now; the passes wait for them (:mod:`arctic_rl.server.jobs.sleep_gate`)
        self.sleep_gate = SleepGate()
        #: the jobs being built or warmed up (:mod:`arctic_rl.server.jobs.background_setup`)
        self.setups = BackgroundSetups()
        self.training_stream = TrainingStream(settings.training_stream)  # apart from the sampler's (.training_stream)

    # ------------------------------------------------------------------ plumbing

    async def _in_thread(self, fn, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(_translate_errors, fn, *args))

    async def run_on_job(self, job: Job, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread under ``job``'s lock (calls on one job run one at a time, in arrival
        order); a 400 if the job was destroyed while the call waited for the lock."""
        await self.setups.idle()  # no pass beside a job's building or warm-up (.background_setup)
        async with job.lock:
            if self.jobs.get(job.job_id, running=False) is not job:  # destroyed while we waited
                raise BadRequest(f"job {job.job_id} was destroyed", field="job_id", received=job.job_id)
            job.calls += 1
            try:
                device = getattr(job.engine, "device", None)
                return await self._in_thread(self.training_stream.call, job.job_id, job.job_type, device, fn, *args)
            finally:
                job.last_call_at = time.time()

    def shutdown(self) -> None:
        for job in self.jobs.all():
            if job.engine is not None:
                try:
                    job.engine.close()
                except Exception:
                    logger.exception("closing job %d failed", job.job_id)
        self._pool.shutdown(wait=False, cancel_futures=True)
        thaw(self.settings.gc_freeze)

    def _log_jobs(self) -> None:
        jobs = ", ".join(f"{j.job_id}:{j.job_type.value}({j.state})" for j in self.jobs.all()) or "none"
        logger.info("jobs: %s", jobs)

    # ------------------------------------------------------------------ control plane

    def health(self) -> dict[str, Any]:
        return {
            "status": "OK",
            "server": SERVER_NAME,
            "version": arctic_rl.__version__,
            "protocol": int(ProtocolVersion.V2),
            "instance_id": self.instance_id,
            "features": list(FEATURES),
        }

    def status(self) -> dict[str, Any]:
        return {
            "status": "OK",
            "server": SERVER_NAME,
            "instance_id": self.instance_id,
            "device": self.settings.device,
            "uptime_s": time.time() - self.started_at,
            "jobs": {str(job.job_id): _with_memory(job) for job in self.jobs.all()},
        }

    def job_info(self, job_id: int) -> dict[str, Any]:
        return self.jobs.get(job_id, running=False).info()

    async def initialize(self, config: JobConfig) -> dict[str, Any]:
        """Build the job, answer, then warm it up in the background (:mod:`arctic_rl.server.jobs.background_setup`)."""
        await self.setups.idle()  # one job built or warming up at a time
        others = self.jobs.all()
        job_dir = None
        if config.job_type == JobType.TRAINING:
            job_dir = ckpt.job_directory(self.settings.checkpoint_root, config.checkpoint_path, "training")
        job = self.jobs.reserve(config, job_dir)
        logger.info("initialize: job %d (%s) from %s", job.job_id, job.job_type.value, config.model_name)
        t0 = time.perf_counter()
        try:
            await self.setups.run(job.job_id, job_setup(job, others, self.settings, self._in_thread))
        except BaseException:
            self.jobs.remove(job.job_id)
            raise
        logger.info("initialize: job %d ready in %.1fs%s", job.job_id, time.perf_counter() - t0,
                    "; its warm-up runs now, its calls wait for it" if job.warming_up else "")
        self._log_jobs()
        return {"job_id": job.job_id, "job_type": job.job_type.value, "running": True}

    async def destroy(self, job_id: int, request: DestroyRequest | None) -> dict[str, Any]:
        job = self.jobs.get(job_id, running=False)
        if request is not None and request.job_type != job.job_type:
            raise BadRequest(
                f"job {job_id} is a {job.job_type.value} job",
                field="job_type",
                allowed=[job.job_type.value],
                received=request.job_type.value,
            )
        async with job.lock:
            self.jobs.remove(job_id)
            if job.engine is not None:
                frozen = thaw(self.settings.gc_freeze)  # the job's objects may sit in cycles holding device memory
                await self._in_thread(job.engine.close)
                job.engine = None
                if frozen:
                    await self._in_thread(freeze_long_lived, self.settings.gc_freeze, f"after destroying job {job_id}")
        self.idempotency.drop_scope(f"job:{job_id}")
        self.training_stream.drop(job_id)
        logger.info("destroy: job %d (%s)", job_id, job.job_type.value)
        self._log_jobs()
        return {"job_id": job_id, "job_type": job.job_type.value, "destroyed": True}

    # ------------------------------------------------------------------ training data plane

    async def forward_backward(self, job_id: int, body: Any) -> dict[str, Any]:
        job = self.jobs.get(job_id, JobType.TRAINING)

        def run():
            batch = parse_batch_body(body, vocab_size=job.engine.vocab_size, train=True)
            self.sleep_gate.before_pass(job.job_id)
            return batch, job.engine.forward_backward(batch)

        t0 = time.perf_counter()
        batch, out = await self.run_on_job(job, run)
        m = out["metrics"]
        logger.info(
            "forward-backward job=%d loss_fn=%s rows=%d tokens=%d computed=%d loss=%.5g micro-batches=%d %.2fs",
            job_id,
            batch.loss_name,
            batch.rows,
            batch.rows * batch.total_len,
            m["tokens_computed"],
            m.get("loss", float("nan")),
            m["micro_batches"],
            time.perf_counter() - t0,
        )
        m.update(memory_metrics(self.jobs.all()))  # every job's parts: memory/<job type>/<part>_gib
        return {"job_id": job_id, **out}

    async def forward(self, job_id: int, body: Any) -> dict[str, Any]:
        job = self.jobs.get(job_id, JobType.TRAINING, JobType.LOG_PROB)

        def run():
            batch = parse_batch_body(body, vocab_size=job.engine.vocab_size, train=False)
            self.sleep_gate.before_pass(job.job_id)
            return batch, job.engine.forward(batch)

        t0 = time.perf_counter()
        batch, (tensors, metrics, alignment) = await self.run_on_job(job, run)
        logger.info("forward job=%d (%s) rows=%d tokens=%d alignment=%s %.2fs", job_id, job.job_type.value, batch.rows,
                    batch.rows * batch.total_len, alignment.value, time.perf_counter() - t0)
        return {"job_id": job_id, "batch": tensors, "metrics": metrics, "logprob_alignment": alignment.value}

    async def step(self, job_id: int, request: StepRequest) -> dict[str, Any]:
        job = self.jobs.get(job_id, JobType.TRAINING)
        t0 = time.perf_counter()
        out = await self.run_on_job(job, job.engine.step, request.learning_rate)
        m = out["metrics"]
        logger.info("step job=%d global_step=%d grad_norm=%s lr=%.3g %.2fs", job_id, m["global_step"], m["grad_norm"],
                    m["last_lr"], time.perf_counter() - t0)
        return {"job_id": job_id, **out}

    def _base(self, job: Job, path: str | None) -> Path:
        if path is None:
            if job.job_dir is None:
                raise BadRequest("path: required (the job has no directory)", field="path")
            return job.job_dir
        return ckpt.resolve_request_path(self.settings.checkpoint_root, path)

    async def save(self, job_id: int, request: SaveRequest) -> dict[str, Any]:
        job = self.jobs.get(job_id, JobType.TRAINING)
        base = self._base(job, request.path)
        if request.checkpoint_type not in ("resumable", "full"):
            logger.info("save: checkpoint_type=%r saved as a resumable checkpoint", request.checkpoint_type)

        def run():
            step = request.step if request.step is not None else job.engine.global_step
            target = ckpt.checkpoint_dir(base, step)
            out = job.engine.save(target, export_hf=request.export_hf)
            ckpt.write_latest(base, target.name)
            pruned = (
                ckpt.prune_checkpoints(base, request.save_total_limit, protect=target)
                if request.save_total_limit
                else []
            )
            return {**out, "pruned": [str(p) for p in pruned]}

        t0 = time.perf_counter()
        out = await self.run_on_job(job, run)
        logger.info(
            "save job=%d -> %s (step %d) %.2fs", job_id, out["path"], out["global_step"], time.perf_counter() - t0
        )
        return {"job_id": job_id, **out}

    async def load_checkpoint(self, job_id: int, request: LoadCheckpointRequest) -> dict[str, Any]:
        job = self.jobs.get(job_id, JobType.TRAINING)
        base = self._base(job, request.path)
        target = ckpt.find_checkpoint(self.settings.checkpoint_root, base, request.step)
        t0 = time.perf_counter()
        out = await self.run_on_job(job, job.engine.load, target)
        logger.info(
            "load-checkpoint job=%d <- %s (step %d) %.2fs", job_id, target, out["global_step"], time.perf_counter() - t0
        )
        return {"job_id": job_id, **out}

    # ------------------------------------------------------------------ weight sync and generation

    async def weight_sync(self, job_id: int | None, request: WeightSyncRequest) -> dict[str, Any]:
        if job_id is not None and job_id != request.source_sub_job_id:
            raise BadRequest(
                "source_sub_job_id: must be the training job named by ?job_id=",
                field="source_sub_job_id",
                allowed=job_id,
                received=request.source_sub_job_id,
            )
        source = self.jobs.get(request.source_sub_job_id, JobType.TRAINING)
        targets = [
            self.jobs.get(t, JobType.SAMPLING, JobType.LOG_PROB) for t in dict.fromkeys(request.target_sub_job_ids)
        ]
        ordered = sorted([source, *targets], key=lambda j: j.job_id)

        t0 = time.perf_counter()
        await self.setups.idle()  # no sync beside a job's building or warm-up (.background_setup)
        for job in ordered:  # fixed order: no deadlock with a concurrent sync
            await job.lock.acquire()
        try:
            versions, released = await self._in_thread(load_weights_into, source, targets, self.training_stream,
                                                       self.settings.release_at_sync == "on")
        finally:
            for job in reversed(ordered):
                job.lock.release()
        logger.info("weight-sync %d -> %s versions=%s %.2fs%s", source.job_id, list(versions), versions,
                    time.perf_counter() - t0, f"; {released['allocator_released_bytes'] / 1e9:.2f} GB of unused "
                    "cached blocks released" if released else "")
        return {
            "job_id": source.job_id,
            "synced": list(versions),
            "weight_version": max(versions.values()),
            "weight_versions": {str(k): v for k, v in versions.items()},
            "seconds": time.perf_counter() - t0,
            **released,  # allocator_*_bytes under --release-at-sync on (.weight_sync)
        }

    async def generate(self, job_id: int, body: Any) -> dict[str, Any]:
        from arctic_rl.server.engines.sampling import parse_generate_request

        job = self.jobs.get(job_id, JobType.SAMPLING)
        request, params = parse_generate_request(body)
        t0 = time.perf_counter()
        results = await self._generate_continuous(job, request, params)
        tokens = sum(r["generation_len"] for r in results)
        logger.info("generate job=%d prompts=%d n=%d tokens=%d %.3fs", job_id, len(request.prompts), params.n, tokens,
                    time.perf_counter() - t0)
        version = results[0]["weight_version"] if results else job.engine.weight_version
        return {"job_id": job_id, "results": results, "weight_version": version}

    async def _generate_continuous(self, job: Job, request: Any, params: Any) -> list[dict[str, Any]]:
        """A ``/generate`` call on a sampler that batches continuously: no job lock -- the call joins the running
        batch and is answered when its own sequences end; the answer is built in a worker thread. Weight syncs,
        sleep and wake (under the job lock) are ordered with the calls inside the engine
        (:mod:`arctic_rl.server.engines.continuous`)."""
        from arctic_rl.server.engines.continuous import LoopClosed

        job.calls += 1
        job.generating += 1
        try:
            await job.admitting.wait()  # the sampler may sleep while another job is built (.setup_hold)
            pending = await self._in_thread(job.engine.submit_generate, request, params)
            try:
                raw = await asyncio.wrap_future(pending.future)
            except asyncio.CancelledError:
                pending.cancel()
                raise
            except ValueError as exc:  # the engine refused a request (a vLLM validation error)
                raise BadRequest(str(exc)) from None
            return await self._in_thread(pending.finish, raw)
        except LoopClosed as exc:  # destroyed while the call waited or ran
            raise Conflict(f"job {job.job_id}: {exc}", field="job_id", received=job.job_id) from None
        finally:
            job.generating -= 1
            job.last_call_at = time.time()
