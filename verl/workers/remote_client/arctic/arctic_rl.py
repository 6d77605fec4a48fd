"""``ArcticRLClient``: verl's remote backend ``"arctic"`` -- the client of an Arctic RL server.

The driver creates one with ``RemoteBackendRegistry.create("arctic", config)``: it (optionally)
starts a local reference server, creates the sampling, log_prob and training jobs, and hands
``reconnect_handle()`` -- URL, protocol generation, job ids, step and server instance id, never the
token -- to verl's workers and rollout replicas, which re-attach with
``from_config(config, handle=handle)`` and create nothing. ``destroy()`` releases only the jobs
this instance created (and the local server it started); a re-attached instance owns nothing.

Compute methods take and return ``TensorDict``s exactly like verl 0.9.1's
``ActorRolloutRefWorker`` (``verl/workers/engine_workers.py``), so a verl worker only forwards:

* ``compute_log_prob`` -- ``/forward`` on the training job; nested ``log_probs`` (and ``entropy``
  when the batch asks ``calculate_entropy``) with the offsets of ``input_ids``, ``metrics{mfu}``;
* ``compute_ref_log_prob`` -- the same on the log_prob job;
* ``update_actor`` -- for each of ``epochs`` x mini-batches: one ``/forward-backward`` (the server
  splits it into ``gradient_accumulation_steps`` micro-batches), then one ``/step``; rollout
  importance weights folded into the advantages (:func:`.layout.fold_is_weights`); metrics under
  verl's names (:mod:`.metrics`), the call's token means as the server reports them;
* ``generate`` -- one ``/generate`` call for a list of token-id prompts.

The client is the session: it creates, re-attaches to and destroys the jobs, and holds the run's
:class:`~.state.RunState` (job ids, step, instance id, owned jobs) that its roles share:
:class:`~.training.Trainer` (``update_actor`` and ``/step``), :class:`~.log_probs.LogProbs`,
:class:`~.generation.Sampler`, :class:`~.checkpoints.Checkpoints` (weight sync, save, load) and
:class:`~.sampler_memory.SamplerMemory` (the sampler's sleep and wake between generation phases).
The v1/v2 differences are one :class:`~.dialect.Dialect` object; bodies are built from the models of
:mod:`arctic_rl.protocol`. The job configs come from :mod:`.builders`, HTTP is :mod:`.http`, and what
happens when the server fails -- unanswered calls, restarts, the journal of updates since the last
checkpoint -- :mod:`.recovery`. Every job this run creates carries its ``client_tag`` (also in the handle).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import uuid
import weakref
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from arctic_rl.protocol import Features, GenerateResult, HealthResponse, JobType, Paths, ProtocolVersion
from verl.remote_backend.base import RemoteBackend
from verl.remote_backend.errors import RemoteBackendError, RemoteJobNotFoundError
from verl.remote_backend.workers.sampler_sleep import RELEASED

from ..common.verl_settings import VerlSettings
from .arctic_config import ArcticConfig
from .builders import plan_batches
from .checkpoint_schedule import CheckpointSchedule
from .checkpoints import Checkpoints, weight_sync_request
from .concurrency import answers_stay_whole, jobs_run_concurrently
from .dialect import Dialect, dialect_for
from .generation import Sampler, SeedDeriver
from .http import ArcticHttp, resolve_token
from .jobs import (
    HANDLE_VERSION,
    JOB_ORDER,
    check_handle,
    create_job,
    destroy_jobs,
    job_bodies,
    read_health,
    tagged_jobs,
)
from .layout import LAYOUT_KEYS, RESPONSE_KEYS
from .local_server import LocalServer, start_local_server
from .log_probs import LogProbs
from .loss_config import build_loss_config, check_loss_support
from .metrics import FlopsEstimator
from .recovery import Recovery
from .sampler_memory import SamplerMemory
from .session import JobCalls, ModelTokens
from .state import RunState
from .training import Trainer
from .wire import detect_protocol

__all__ = ["ArcticRLClient"]

logger = logging.getLogger(__name__)


def _destroy_at_exit(ref: weakref.ref) -> None:
    client = ref()
    if client is not None:
        client.destroy()


class ArcticRLClient(RemoteBackend):
    """The Arctic RL adapter (see the module docstring). Build it with :meth:`from_config`."""

    #: the config mirror of ``remote_backend.*``; a backend registered under another name with this class (or a
    #: subclass) is accepted by it under that name
    config_class = ArcticConfig
    #: what ``remote_backend.server.url: null`` means (the preflight check's hint)
    null_url_means = "start the bundled reference server on this machine"

    def __init__(self, *, arctic: ArcticConfig, verl: VerlSettings, http: ArcticHttp, protocol: ProtocolVersion,
                 health: HealthResponse, job_ids: dict[str, int], owned: bool, step: int = 0,
                 local_server: LocalServer | None = None, client_tag: str | None = None) -> None:
        self.arctic = arctic
        self.verl = verl
        self.protocol = ProtocolVersion(protocol)
        self.dialect: Dialect = dialect_for(self.protocol)
        #: this run's label on every job it creates (so restored jobs can be told from others')
        self.client_tag = client_tag
        self._state = RunState(http=http, dialect=self.dialect, features=frozenset(health.features),
                               job_ids=dict(job_ids), owned=dict(job_ids) if owned else {},
                               instance_id=health.instance_id, client_tag=client_tag, step=int(step))
        http.idempotency = Features.IDEMPOTENCY in self._state.features and arctic.retry.server_idempotency == "auto"
        # built in dependency order: state, recovery (its own call: the weight sync of a restore), calls, roles
        state, sync = self._state, weight_sync_request(arctic)
        recovery = self._recovery = Recovery(state, arctic.recovery, weight_sync=sync,
                                             job_bodies=lambda: job_bodies(verl, arctic, client_tag, state.features))
        self._local = local_server
        calls = JobCalls(state, recovery)
        schedule = CheckpointSchedule(arctic.recovery, recovery.journal, recovery.stats,
                                      job_info=functools.partial(calls.job_info, JobType.TRAINING),
                                      default_path=arctic.train.checkpoint_path)
        self._tokens = ModelTokens(verl.tokenizer_path, trust_remote_code=verl.trust_remote_code)
        flops = FlopsEstimator(verl.model_path, peak_tflops_per_device=arctic.mfu.peak_tflops_per_device,
                               trust_remote_code=verl.trust_remote_code)
        self._checkpoints = Checkpoints(calls, state, recovery, arctic=arctic, weight_sync=sync)
        self._trainer = Trainer(calls, state, schedule, verl=verl, arctic=arctic, plan=plan_batches(verl, arctic),
                                flops=flops, tokens=self._tokens, save_checkpoint=self._checkpoints.save_checkpoint)
        self._log_probs = LogProbs(calls, state, verl=verl, arctic=arctic, flops=flops, tokens=self._tokens)
        self._sampler = Sampler(calls, state, tokens=self._tokens,
                                seeds=SeedDeriver(verl.rollout_seed) if verl.rollout_full_determinism else None)
        self._memory = SamplerMemory(calls, state, sleep_between_phases=verl.rollout_sleeps_between_phases)
        self._atexit = functools.partial(_destroy_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------ lifecycle

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict | None = None, owner: bool = False) -> ArcticRLClient:
        """Create the jobs (``handle=None``) or re-attach to those of ``handle``.

        ``owner=True`` with a handle makes this instance responsible for destroying the handle's
        jobs (a recovery process cleaning up after a crashed driver); workers never pass it.
        """
        arctic = ArcticConfig.from_main_config(main_config)
        verl = VerlSettings.from_main_config(main_config)
        if handle is not None:
            return cls._attach(arctic, verl, handle, owner=owner)
        local_cfg = arctic.server.local
        if arctic.server.url is None:
            if local_cfg.checkpoint_root is None and verl.default_local_dir:
                root = Path(verl.default_local_dir).expanduser().resolve() / "arctic_server"
                local_cfg = dataclasses.replace(local_cfg, checkpoint_root=str(root))
            if arctic.train.checkpoint_path is None:  # our own server: checkpoints go to <root>/training
                arctic = dataclasses.replace(arctic, train=dataclasses.replace(arctic.train, checkpoint_path="training"))
        tag = uuid.uuid4().hex
        bodies = job_bodies(verl, arctic, tag)  # every config error before any side effect
        build_loss_config(verl, loss_scale_tokens=None)
        if arctic.train.zorro_train.enable and verl.enable_gradient_checkpointing:
            logger.info("arctic: ZoRRO is on, so the reference server does not checkpoint activations "
                        "(actor_rollout_ref.model.enable_gradient_checkpointing=true is ignored there: checkpointed "
                        "layers re-run without the prompt keys that ZoRRO shares)")
        local = None
        if arctic.server.url is None:
            local = start_local_server(local_cfg, token=resolve_token(arctic.server.token))
        url = local.url if local is not None else arctic.server.url
        http = cls._new_http(arctic, url)
        client = None
        try:
            health = read_health(http)
            protocol = detect_protocol(http, arctic.server.protocol)
            check_loss_support(verl, frozenset(health.features))  # what the server's loss cannot do: before any job
            client = cls(arctic=arctic, verl=verl, http=http, protocol=protocol, health=health, job_ids={},
                         owned=True, local_server=local, client_tag=tag)
            if not health.features:  # not our reference server (the vendor's /health lists no features)
                attn = bodies[JobType.TRAINING]["ds_worker_config"]["attn_implementation"]
                if not str(attn).startswith("flash"):
                    logger.warning("arctic: remote_backend.train.attn_implementation=%s: the vendor's server packs the "
                                   "rows of a call into one sequence that only a flash-attention backend keeps apart "
                                   "(rows attend to each other with %s)", attn, attn)
            bodies = job_bodies(verl, arctic, tag, frozenset(health.features))  # what this server takes
            for job_type in JOB_ORDER:
                job_id = create_job(http, job_type, bodies[job_type], tag=tag,
                                    reclaim_idle_s=arctic.server.reclaim_idle_jobs_s)
                client._state.job_ids[job_type.value] = client._state.owned[job_type.value] = job_id
        except BaseException:
            if client is not None:
                client.destroy()
            else:
                http.close()
                if local is not None:
                    local.stop()
            raise
        logger.info("arctic: jobs %s on %s (protocol v%d, features %s)", client.job_ids, url, int(protocol),
                    sorted(client.features))
        return client

    @classmethod
    def _attach(cls, arctic: ArcticConfig, verl: VerlSettings, handle: dict, *, owner: bool) -> ArcticRLClient:
        h = check_handle(handle)
        if arctic.server.url and arctic.server.url.rstrip("/") != h["url"].rstrip("/"):
            logger.warning("arctic: attaching to %s from the handle (remote_backend.server.url says %s)", h["url"],
                           arctic.server.url)
        http = cls._new_http(arctic, h["url"])
        try:
            health = read_health(http)
            if h["instance_id"] and health.instance_id and health.instance_id != h["instance_id"]:
                raise RemoteJobNotFoundError(
                    f"GET {Paths.HEALTH}", 404,
                    f"the server at {h['url']} restarted (instance {health.instance_id}, the handle was made on "
                    f"{h['instance_id']}): jobs {h['job_ids']} are gone; restart the run (or resume it from a checkpoint)")
            return cls(arctic=arctic, verl=verl, http=http, protocol=ProtocolVersion(h["protocol"]), health=health,
                       job_ids=h["job_ids"], owned=owner, step=h["step"], client_tag=h.get("client_tag"))
        except BaseException:
            http.close()
            raise

    @staticmethod
    def _new_http(arctic: ArcticConfig, url: str) -> ArcticHttp:
        return ArcticHttp(url, timeouts=arctic.timeouts, retry=arctic.retry, token=arctic.server.token,
                          pool_size=arctic.server.pool_size)

    def reconnect_handle(self) -> dict:
        """JSON-serializable; no token (each process reads it from config or ``ARCTIC_RL_TOKEN``)."""
        state = self._state
        return {
            "backend": "arctic",
            "handle_version": HANDLE_VERSION,
            "url": state.http.base_url,
            "protocol": int(self.protocol),
            "job_ids": dict(state.job_ids),
            "step": int(state.step),
            "instance_id": state.instance_id,
            "client_tag": self.client_tag,
        }

    def destroy(self) -> None:
        """Destroy the jobs this instance created and stop the server it started. Idempotent."""
        state = self._state
        with state.lock:
            if state.destroyed:
                return
            state.destroyed = True
        atexit.unregister(self._atexit)
        self._recovery.close()
        owned, state.owned = state.owned, {}
        destroy_jobs(state.http, self._still_ours(owned))
        state.http.close()
        if self._local is not None:
            self._local.stop()

    def requires_single_forwarder(self) -> bool:
        return True  # the server shards the work itself; one verl worker forwards

    def _still_ours(self, owned: dict[str, int]) -> dict[str, int]:
        """The jobs to destroy: ``owned`` while the server is the process that created them, plus any
        job carrying this run's tag (jobs restored after a restart). After a restart the old ids may
        name another run's jobs, so they are left alone unless tagged ours."""
        if not owned:
            return {}
        health = self._state.http.probe(Paths.HEALTH)
        if not isinstance(health, dict):  # unreachable: try the ids we know (destroy_jobs logs failures)
            return owned
        now = health.get("instance_id")
        known = self._state.instance_id
        same = now is None or known is None or now == known
        try:
            tagged = tagged_jobs(self._state.http, self.client_tag) if self.client_tag else None
        except RemoteBackendError:
            tagged = None
        if same:
            return {**owned, **(tagged or {})}
        if tagged is None:
            logger.warning("arctic: the server restarted (instance %s, jobs were made on %s) and does not echo job "
                           "tags: not destroying ids %s, which may now be another run's", now, known, owned)
            return {}
        return tagged

    def reliability_stats(self) -> dict[str, int]:
        """What the failure handling did: HTTP retries by reason, replays, restores, journal replays, ..."""
        return {**self._state.http.stats, **{f"recovery/{k}": v for k, v in self._recovery.stats.items()}}

    def drain_call_times(self) -> dict[str, float]:
        """This client's HTTP calls since the last drain: count, wall seconds and the server's own seconds
        (:class:`~verl.remote_backend.protocols.ReportsCallTimes`; the reference server reports them, the
        vendor's does not)."""
        return self._state.http.call_times.drain().as_mapping()

    # ------------------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        return self._state.http.base_url

    @property
    def job_ids(self) -> dict[str, int]:
        return dict(self._state.job_ids)

    @property
    def owned_job_ids(self) -> dict[str, int]:
        return dict(self._state.owned)

    @property
    def features(self) -> frozenset[str]:
        return self._state.features

    def concurrent_jobs(self) -> tuple[bool, str]:
        """Whether the server answers ``/generate`` while the training job computes (:mod:`.concurrency`)."""
        return jobs_run_concurrently(self._state.features, self.arctic.server.concurrent_jobs)

    def weight_sync_keeps_answers_whole(self) -> tuple[bool, str]:
        """Whether each ``/generate`` answer comes from one weight version across a weight sync (:mod:`.concurrency`)."""
        return answers_stay_whole(self._state.features)

    @property
    def step(self) -> int:
        """Optimizer steps taken (as the server reports its global step)."""
        return self._state.step

    @property
    def tokenizer(self) -> Any:
        return self._tokens.tokenizer

    @property
    def pad_token_id(self) -> int:
        """Fills padded columns (always masked): the tokenizer's pad (or eos) id, else 0."""
        return self._tokens.pad_token_id

    # ------------------------------------------------------------------------------ compute (delegated by role)

    @classmethod
    def tensor_fields_read(cls, method: str) -> frozenset[str] | None:
        """The fields of verl's batch each compute method may read (``ReadsTensorFields``): the token layout's,
        and for ``update_actor`` the response-shaped RL tensors too. The forwarder's dispatch fetches no others."""
        if method in ("compute_log_prob", "compute_ref_log_prob"):
            return frozenset(LAYOUT_KEYS)
        if method == "update_actor":
            return frozenset(LAYOUT_KEYS + RESPONSE_KEYS)
        return None

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs of the current policy (``/forward`` on the training job)."""
        with self._recovery.training_call():
            return self._log_probs.compute(data, JobType.TRAINING)

    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs of the reference policy (``/forward`` on the log_prob job)."""
        with self._recovery.training_call():
            return self._log_probs.compute(data, JobType.LOG_PROB)

    def update_actor(self, data: TensorDict) -> TensorDict:
        """PPO/GRPO update: ``epochs`` x mini-batches of (one ``/forward-backward``, one ``/step``)."""
        with self._recovery.training_call():
            return self._trainer.update_actor(data)

    def generate(self, prompts: list[list[int]], sampling_params: dict | None = None) -> list[GenerateResult]:
        """One ``/generate`` call; results in prompt order, ``n`` samples of a prompt adjacent."""
        return self._sampler.generate(prompts, sampling_params)

    def sleep_sampler(self, level: int) -> dict:
        """Free the sampler's memory between generation phases (``/sleep-inference``; :mod:`.sampler_memory`)."""
        return self._memory.sleep(level)

    def wake_sampler(self, tags: list[str] | None = None) -> dict:
        """Restore the sampler's memory (``/wake-inference``; ``None``: all parts)."""
        return self._memory.wake(tags)

    # ------------------------------------------------------------------------------ weights, checkpoints

    def update_weights(self) -> dict:
        """Push the training job's weights to the sampler (and to the log_prob job if configured), then
        drop the sampler's prefix cache where the server has ``/reset-prefix-cache``. The answer carries
        ``released_bytes`` where the server released cached blocks as the weights woke."""
        released = self._memory.before_weight_sync()
        out = self._checkpoints.update_weights()
        return out if released is None else {**out, RELEASED: released}

    def save_checkpoint(self, step: int | None = None, *, path: str | None = None, export_hf: bool = False,
                        save_total_limit: int | None = None) -> dict:
        """Save model + optimizer + step on the server (``step`` names it; default: the server's step).

        Saving the same state twice is harmless, so an unanswered save is re-sent. A restart after
        this restores this checkpoint (and replays only what follows it)."""
        return self._checkpoints.save_checkpoint(step, path=path, export_hf=export_hf,
                                                 save_total_limit=save_total_limit)

    def load_checkpoint(self, step: int | None = None, *, path: str | None = None, sync_weights: bool = True) -> dict:
        """Restore model + optimizer + step (v2 servers only), then refresh the sampler's weights."""
        return self._checkpoints.load_checkpoint(step, path=path, sync_weights=sync_weights)
