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

The wire layout is built by :mod:`.layout`, the job configs by :mod:`.builders`, HTTP is
:mod:`.http`, body encoding (v1 ``torch.save`` / v2 DSSST1) :mod:`.wire`, and what happens when the
server fails -- unanswered calls, restarts, the journal of updates since the last checkpoint --
:mod:`.recovery`. Every job this run creates carries its ``client_tag`` (also in the handle).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from arctic_rl.protocol import (
    ENTROPY_KEY,
    JSON_MEDIA_TYPE,
    LOGPROB_ALIGNMENT_KEY,
    LOGPROBS_KEY,
    OCTET_STREAM,
    Features,
    GenerateResult,
    HealthResponse,
    JobType,
    LoadCheckpointResponse,
    LogprobAlignment,
    Paths,
    ProtocolVersion,
    ResetPrefixCacheRequest,
)
from verl.remote_backend.base import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend.errors import (
    RemoteBackendConfigError,
    RemoteBackendError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
    RemoteServerError,
)
from verl.utils import tensordict_utils as tu

from .arctic_config import ArcticConfig
from .builders import build_job_config, build_loss_config, build_meta, plan_batches, vendor_ignored_settings
from .generation import SeedDeriver, clean_sampling_params, ordered_results
from .http import ArcticHttp, resolve_token
from .jobs import HANDLE_VERSION, JOB_ORDER, check_handle, create_job, destroy_jobs, read_health, tagged_jobs
from .layout import (
    RESPONSE_KEYS,
    dense_batch,
    fold_is_weights,
    nested_from_server,
    plan_layout,
    shuffled_rows,
    split_rows,
)
from .local_server import LocalServer, start_local_server
from .metrics import FlopsEstimator, mini_batch_metrics
from .journal import CheckpointRef
from .recovery import APPLIED, Recovery
from .verl_settings import VerlSettings
from .wire import decode_response, detect_protocol, encode_body

__all__ = ["ArcticRLClient"]

logger = logging.getLogger(__name__)

#: the vendor scales logits by ``meta.temperature`` only under ``apply_temperature``: old log-probs must be
#: computed at the sampling temperature exactly as the ``/forward-backward`` of the update is
_FORWARD_POST = ["apply_temperature", "compute_entropy_and_logprobs"]
_TRAIN_POST = ["apply_temperature", "compute_entropy_and_logprobs"]


def _destroy_at_exit(ref: weakref.ref) -> None:
    client = ref()
    if client is not None:
        client.destroy()


@RemoteBackendRegistry.register("arctic")
class ArcticRLClient(RemoteBackend):
    """The Arctic RL adapter (see the module docstring). Build it with :meth:`from_config`."""

    def __init__(self, *, arctic: ArcticConfig, verl: VerlSettings, http: ArcticHttp, protocol: ProtocolVersion,
                 health: HealthResponse, job_ids: dict[str, int], owned: bool, step: int = 0,
                 local_server: LocalServer | None = None, client_tag: str | None = None) -> None:
        self.arctic = arctic
        self.verl = verl
        self.protocol = ProtocolVersion(protocol)
        self._http = http
        self._features = frozenset(health.features)
        self._instance_id = health.instance_id
        self._job_ids: dict[str, int] = dict(job_ids)
        self._owned: dict[str, int] = dict(job_ids) if owned else {}
        self._step = int(step)
        http.step = self._step
        http.idempotency = Features.IDEMPOTENCY in self._features and arctic.retry.server_idempotency == "auto"
        #: this run's label on every job it creates (so restored jobs can be told from others')
        self.client_tag = client_tag
        self._recovery = Recovery(self, arctic.recovery)
        if self._step:
            self._recovery.journal.start_unknown(self._step)
        self._local = local_server
        self._plan = plan_batches(verl, arctic)
        self._flops = FlopsEstimator(verl.model_path, peak_tflops_per_device=arctic.mfu.peak_tflops_per_device,
                                     trust_remote_code=verl.trust_remote_code)
        self._tokenizer: Any = None
        self._seeds = SeedDeriver(verl.rollout_seed) if verl.rollout_full_determinism else None
        self._destroyed = False
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._atexit = functools.partial(_destroy_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------ lifecycle

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict | None = None, owner: bool = False) -> "ArcticRLClient":
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
        bodies = _tagged_bodies(verl, arctic, tag)  # every config error before any side effect
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
            client = cls(arctic=arctic, verl=verl, http=http, protocol=protocol, health=health, job_ids={},
                         owned=True, local_server=local, client_tag=tag)
            if not health.features:  # not our reference server (the vendor's /health lists no features)
                attn = bodies[JobType.TRAINING]["ds_worker_config"]["attn_implementation"]
                if not str(attn).startswith("flash"):
                    logger.warning("arctic: remote_backend.train.attn_implementation=%s: the vendor's server packs the "
                                   "rows of a call into one sequence that only a flash-attention backend keeps apart "
                                   "(rows attend to each other with %s)", attn, attn)
                for line in vendor_ignored_settings(verl):
                    logger.warning("arctic: the server at %s lists no features (the vendor's server): it ignores %s; "
                                   "the update runs with the vendor's value", url, line)
            for job_type in JOB_ORDER:
                job_id = create_job(http, job_type, bodies[job_type], tag=tag,
                                    reclaim_idle_s=arctic.server.reclaim_idle_jobs_s)
                client._job_ids[job_type.value] = client._owned[job_type.value] = job_id
        except BaseException:
            if client is not None:
                client.destroy()
            else:
                http.close()
                if local is not None:
                    local.stop()
            raise
        logger.info("arctic: jobs %s on %s (protocol v%d, features %s)", client._job_ids, url, int(protocol),
                    sorted(client._features))
        return client

    @classmethod
    def _attach(cls, arctic: ArcticConfig, verl: VerlSettings, handle: dict, *, owner: bool) -> "ArcticRLClient":
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
        return {
            "backend": "arctic",
            "handle_version": HANDLE_VERSION,
            "url": self._http.base_url,
            "protocol": int(self.protocol),
            "job_ids": dict(self._job_ids),
            "step": int(self._step),
            "instance_id": self._instance_id,
            "client_tag": self.client_tag,
        }

    def destroy(self) -> None:
        """Destroy the jobs this instance created and stop the server it started. Idempotent."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
        atexit.unregister(self._atexit)
        self._recovery.close()
        owned, self._owned = self._owned, {}
        destroy_jobs(self._http, self._still_ours(owned))
        self._http.close()
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
        health = self._http.probe(Paths.HEALTH)
        if not isinstance(health, dict):  # unreachable: try the ids we know (destroy_jobs logs failures)
            return owned
        now = health.get("instance_id")
        same = now is None or self._instance_id is None or now == self._instance_id
        try:
            tagged = tagged_jobs(self._http, self.client_tag) if self.client_tag else None
        except RemoteBackendError:
            tagged = None
        if same:
            return {**owned, **(tagged or {})}
        if tagged is None:
            logger.warning("arctic: the server restarted (instance %s, jobs were made on %s) and does not echo job "
                           "tags: not destroying ids %s, which may now be another run's", now, self._instance_id, owned)
            return {}
        return tagged

    def _job_bodies(self) -> dict[JobType, dict]:
        """The ``/initialize`` bodies of this run's jobs (used again to restore them after a restart)."""
        return _tagged_bodies(self.verl, self.arctic, self.client_tag)

    def _publish_jobs(self, job_ids: dict[str, int], instance_id: str | None, *, created: dict[str, int]) -> None:
        """Switch to restored or adopted jobs; this client owns (destroys) those it ``created``."""
        self._job_ids = dict(job_ids)
        self._instance_id = instance_id
        self._owned.update(created)

    def reliability_stats(self) -> dict[str, int]:
        """What the failure handling did: HTTP retries by reason, replays, restores, journal replays, ..."""
        return {**self._http.stats, **{f"recovery/{k}": v for k, v in self._recovery.stats.items()}}

    # ------------------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        return self._http.base_url

    @property
    def job_ids(self) -> dict[str, int]:
        return dict(self._job_ids)

    @property
    def owned_job_ids(self) -> dict[str, int]:
        return dict(self._owned)

    @property
    def features(self) -> frozenset[str]:
        return self._features

    @property
    def step(self) -> int:
        """Optimizer steps taken (as the server reports its global step)."""
        return self._step

    def _job(self, job_type: JobType) -> int:
        try:
            return self._job_ids[job_type.value]
        except KeyError:
            raise RemoteBackendError(f"no {job_type.value} job in this backend ({self._job_ids})") from None

    # ------------------------------------------------------------------------------ helpers

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.verl.tokenizer_path,
                                                            trust_remote_code=self.verl.trust_remote_code)
        return self._tokenizer

    @functools.cached_property
    def pad_token_id(self) -> int:
        """Fills padded columns (always masked): the tokenizer's pad (or eos) id, else 0."""
        try:
            tok = self.tokenizer
            value = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            return int(value) if value is not None else 0
        except Exception as exc:  # noqa: BLE001 - padding content is masked anyway
            logger.info("arctic: no tokenizer at %s (%s); padding with id 0", self.verl.tokenizer_path, exc)
            return 0

    def _post_tensors(self, v2_path: str, v1_path: str, job_type: JobType, body: dict, *, op: str,
                      idempotent: bool, counter: tuple[str, int] | None = None) -> dict:
        """POST a tensor body to the job of ``job_type`` (through :class:`~.recovery.Recovery`); a
        ``/forward-backward`` is journalled. ``{}`` for a call applied whose answer was lost."""
        path = v2_path if self.protocol is ProtocolVersion.V2 else v1_path
        payload = encode_body(self.protocol, body)

        def send(request_id: str):
            job_id = self._job(job_type)
            try:
                return self._http.request("POST", path, op=op, params={"job_id": job_id}, data=payload,
                                          content_type=OCTET_STREAM, idempotent=idempotent, request_id=request_id)
            except RemoteServerError as exc:
                forward = path in (Paths.FORWARD, Paths.V1_FWD_NO_GRAD)
                if forward and exc.status == 500 and not isinstance(exc, RemoteJobNotFoundError):
                    self._raise_if_job_gone(f"POST {path}", job_id, exc)
                raise

        resp = self._recovery.call(f"POST {path}", send, safe=idempotent, counter=counter)
        if not idempotent:
            self._recovery.journal.record(path, payload, OCTET_STREAM, is_step=False)
        if resp is APPLIED:
            logger.warning("arctic: the metrics of an applied %s are lost (its answer never came)", path)
            return {}
        out = decode_response(self.protocol, resp, f"POST {path}")
        if not isinstance(out, dict):
            raise RemoteProtocolError(f"POST {path}", f"expected an object, got {type(out).__name__}")
        return out

    def _raise_if_job_gone(self, endpoint: str, job_id: int, exc: RemoteServerError) -> None:
        """The vendor's ``/forward`` (v1: ``/fwd-no-grad``) indexes its job table before checking the id: an
        unknown job is a plain 500 there. ``GET /job/{id}`` tells: a 404 makes it :class:`RemoteJobNotFoundError`."""
        try:
            self._http.request("GET", Paths.job(job_id), op="default")
        except RemoteJobNotFoundError as gone:
            raise RemoteJobNotFoundError(endpoint, 404, f"job {job_id} not found (the server answered HTTP "
                                         f"{exc.status} and GET {Paths.job(job_id)} 404)",
                                         detail=gone.detail) from exc
        except RemoteBackendError:
            pass  # the job read failed too: keep the original error

    def _temperature(self, data: TensorDict) -> float:
        value = tu.get(data, "temperature", None)
        value = self.verl.rollout_temperature if value is None else float(value)
        if value <= 0:  # greedy sampling: score with the plain distribution
            return 1.0
        return value

    def _check_rows(self, rows: int, devices: int, key: str) -> None:
        if rows < devices:
            raise RemoteBackendConfigError(f"remote_backend.{key}.num_devices",
                                           f"a batch of {rows} rows cannot be spread over the job's devices",
                                           allowed=f"<= {rows}", received=devices)

    # ------------------------------------------------------------------------------ compute

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs of the current policy (``/forward`` on the training job)."""
        with self._training_call():
            return self._log_probs(data, JobType.TRAINING)

    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs of the reference policy (``/forward`` on the log_prob job)."""
        with self._training_call():
            return self._log_probs(data, JobType.LOG_PROB)

    def _training_call(self) -> threading.RLock:
        """Held by calls of the training client: a restore never interleaves with them."""
        self._recovery.become_primary()
        return self._recovery.lock

    def _log_probs(self, data: TensorDict, job_type: JobType) -> TensorDict:
        t0 = time.perf_counter()
        zorro = self.arctic.train.zorro_train.enable
        key = "train" if job_type is JobType.TRAINING else "log_prob"
        devices = self.arctic.train.num_devices if job_type is JobType.TRAINING else self.arctic.log_prob.num_devices
        entropy = bool(tu.get(data, "calculate_entropy", False))
        layout = plan_layout(data, response_width=self.verl.max_response_length if zorro else None, group_rows=zorro)
        self._check_rows(layout.rows, devices, key)
        meta = build_meta(self.verl, self.arctic, max_prompt_len=layout.prompt_width,
                          max_response_len=layout.response_width, temperature=self._temperature(data),
                          calculate_entropy=entropy, pad_token_id=self.pad_token_id)
        body = {"batch": dense_batch(data, layout, pad_token_id=self.pad_token_id, keys=()), "meta": meta,
                "processing": {"loss_fn": None, "post": list(_FORWARD_POST), "config": {}}}
        out = self._post_tensors(Paths.FORWARD, Paths.V1_FWD_NO_GRAD, job_type, body, op="forward", idempotent=True)
        endpoint = "POST /forward"
        tensors = out.get("batch") if isinstance(out.get("batch"), dict) else {}
        # the job config says which layout comes back (the vendor's answer carries no key for it)
        alignment = LogprobAlignment.RESPONSE if zorro else LogprobAlignment.SHIFTED
        said = out.get(LOGPROB_ALIGNMENT_KEY) or (out.get("metrics") or {}).get(LOGPROB_ALIGNMENT_KEY)
        if said is not None and said != alignment.value:
            raise RemoteProtocolError(endpoint, f"{LOGPROB_ALIGNMENT_KEY}: the server answered {said!r} log-probs, "
                                      f"but a job with zorro_train.enable={zorro} answers {alignment.value!r} ones")
        result = {"log_probs": nested_from_server(_tensor(tensors, (LOGPROBS_KEY, "log_probs"), endpoint), layout,
                                                  alignment, key=LOGPROBS_KEY, endpoint=endpoint)}
        if entropy:
            result["entropy"] = nested_from_server(_tensor(tensors, (ENTROPY_KEY,), endpoint), layout, alignment,
                                                   key=ENTROPY_KEY, endpoint=endpoint)
        seconds = time.perf_counter() - t0
        metrics = {"mfu": self._flops.mfu(int(layout.offsets[-1]), seconds, devices=devices, training=False)}
        return tu.get_tensordict(result, non_tensor_dict={"metrics": metrics})

    def update_actor(self, data: TensorDict) -> TensorDict:
        """PPO/GRPO update: ``epochs`` x mini-batches of (one ``/forward-backward``, one ``/step``)."""
        with self._training_call():
            return self._update_actor(data)

    def _update_actor(self, data: TensorDict) -> TensorDict:
        plan, verl = self._plan, self.verl
        mini_rows = plan.mini_batch_rows
        for name in ("mini_batch_size", "global_batch_size"):
            asked = tu.get(data, name, None)
            if asked is not None and int(asked) != mini_rows:
                raise RemoteBackendConfigError(
                    "actor_rollout_ref.actor.ppo_mini_batch_size", f"the trainer asks for mini-batches of {asked} rows "
                    f"({name}) but the training job was created for {mini_rows} (ds_config.train_batch_size)",
                    allowed=mini_rows, received=int(asked))
        epochs = int(tu.get(data, "epochs", None) or verl.ppo_epochs)
        loader = tu.get(data, "dataloader_kwargs", None) or {}
        shuffle = bool(loader.get("shuffle", verl.shuffle)) if isinstance(loader, dict) else verl.shuffle
        seed = tu.get(data, "seed", None)
        seed = int(verl.data_loader_seed if seed is None else seed)
        entropy = bool(tu.get(data, "calculate_entropy", False)) or verl.calculate_entropy or verl.entropy_coeff != 0
        zorro = self.arctic.train.zorro_train.enable
        layout = plan_layout(data, response_width=verl.max_response_length if zorro else None, group_rows=zorro)
        if layout.rows % mini_rows:
            raise RemoteBackendConfigError(
                "actor_rollout_ref.actor.ppo_mini_batch_size", f"a batch of {layout.rows} rows does not split into "
                f"mini-batches of {mini_rows} rows (ppo_mini_batch_size x rollout.n)",
                allowed=f"a batch of a multiple of {mini_rows} rows", received=layout.rows)
        if verl.use_kl_loss and "ref_log_prob" not in data.keys():
            raise RemoteBackendConfigError("data.ref_log_prob", "use_kl_loss needs the reference log-probs",
                                           allowed="compute_ref_log_prob before update_actor", received=None)
        keys = tuple(k for k in RESPONSE_KEYS if k in data.keys() and (k != "ref_log_prob" or verl.use_kl_loss))
        batch = dense_batch(data, layout, pad_token_id=self.pad_token_id, keys=keys)
        if "response_mask" not in batch:
            raise RemoteBackendConfigError("data.response_mask", "required by update_actor", received=None)
        fold_is_weights(batch)
        seq_lens = layout.offsets.diff().index_select(0, layout.order)
        temperature = self._temperature(data)
        token_mean = verl.loss_agg_mode == "token-mean"
        out: dict[str, list] = {}
        for epoch in range(epochs):
            rows = shuffled_rows(layout, seed=seed + epoch if shuffle else None)
            for mini in split_rows(rows, mini_rows):
                t0 = time.perf_counter()
                tokens = float(batch["response_mask"].index_select(0, mini).sum())
                scale = (verl.loss_scale_factor or max(tokens, 1.0)) if token_mean else None
                loss = build_loss_config(verl, loss_scale_tokens=scale)
                # one /forward-backward per mini-batch (the server splits it into its GAS micro-batches),
                # then one /step: the vendor's contract. batch_num_tokens in meta is where the vendor reads it.
                meta = build_meta(verl, self.arctic, max_prompt_len=layout.prompt_width,
                                  max_response_len=layout.response_width, temperature=temperature,
                                  calculate_entropy=entropy, pad_token_id=self.pad_token_id,
                                  global_batch_size=mini_rows, batch_num_tokens=scale or tokens, loss=loss)
                processing = {"loss_fn": "verl_grpo", "post": list(_TRAIN_POST), "config": loss.model_dump(mode="json")}
                body = {"batch": {k: v.index_select(0, mini) for k, v in batch.items()}, "meta": meta,
                        "processing": processing}
                res = self._post_tensors(Paths.FORWARD_BACKWARD, Paths.V1_FWD_BWD, JobType.TRAINING, body,
                                         op="forward_backward", idempotent=False,
                                         counter=("pending_forward_backward", 0))
                call_metrics = dict(res.get("metrics") or {})
                if res.get("avg_loss") is not None:
                    call_metrics.setdefault("loss", res["avg_loss"])
                step = self._optimizer_step()
                values = mini_batch_metrics(call_metrics, step, kl_coef=verl.kl_loss_coef if verl.use_kl_loss else None)
                values["mfu"] = self._flops.mfu(int(seq_lens.index_select(0, mini).sum()), time.perf_counter() - t0,
                                                devices=plan.num_devices, training=True)
                for name, value in values.items():
                    out.setdefault(name, []).append(value)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": out})

    def _optimizer_step(self) -> dict:
        body = {} if self.protocol is ProtocolVersion.V2 else None  # v1: no body

        def send(request_id: str):
            return self._http.request("POST", Paths.STEP, op="step", params={"job_id": self._job(JobType.TRAINING)},
                                      json=body, request_id=request_id)

        resp = self._recovery.call(f"POST {Paths.STEP}", send, safe=False, counter=("global_step", self._step))
        self._recovery.journal.record(Paths.STEP, body, None, is_step=True)
        if resp is APPLIED:  # applied, answer lost: what the server's job info still tells
            # count the step first: a restart during the read replays the journal, which now holds it
            self._step += 1
            self._http.step = self._step
            info = self._recovery.training_job_info()
            metrics = {"global_step": self._step, "last_lr": info.get("lr"), "grad_norm": None}
        else:
            metrics = dict(resp.json().get("metrics") or {})
        step = metrics.get("global_step")
        self._step = int(step) if isinstance(step, int) and not isinstance(step, bool) else self._step + 1
        self._http.step = self._step
        if self.protocol is ProtocolVersion.V2:  # v1 servers cannot load a checkpoint back
            self._recovery.after_step(self._step, self.save_checkpoint)
        return metrics

    # ------------------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], sampling_params: dict | None = None) -> list[GenerateResult]:
        """One ``/generate`` call; results in prompt order, ``n`` samples of a prompt adjacent."""
        if not prompts:
            return []
        params = clean_sampling_params(sampling_params or {}, self._warned)
        n = params.n
        expand = n > 1 and Features.N_SAMPLES not in self._features
        rows = [[int(t) for t in p] for p in prompts for _ in range(n if expand else 1)]
        wire_params = params.model_dump(mode="json", exclude_none=True)
        if self._seeds is not None and params.seed is None:  # verl's rollout.full_determinism
            wire_params["seed"] = self._seeds(prompts)
        if expand:
            wire_params["n"] = 1
        if Features.TOKEN_PROMPTS in self._features:
            wire_prompts: list = rows
        else:  # the vendor's servers take text only
            wire_prompts = [self.tokenizer.decode(r, skip_special_tokens=False) for r in rows]
        if self.protocol is ProtocolVersion.V2:
            body = {"prompts": wire_prompts, "sampling_params": wire_params, "routing_key": None, "strict": False}
            out = self._post_tensors(Paths.GENERATE, Paths.GENERATE, JobType.SAMPLING, body, op="generate",
                                     idempotent=True)
        else:  # v1: JSON in, JSON out
            def send(request_id: str):
                return self._http.request("POST", Paths.GENERATE, op="generate",
                                          params={"job_id": self._job(JobType.SAMPLING)},
                                          json={"prompts": wire_prompts, "sampling_params": wire_params},
                                          content_type=JSON_MEDIA_TYPE, idempotent=True, request_id=request_id)

            out = self._recovery.call(f"POST {Paths.GENERATE}", send, safe=True).json()
        return ordered_results(out, len(prompts), n, expanded=expand)

    # ------------------------------------------------------------------------------ weights, checkpoints

    def update_weights(self) -> dict:
        """Push the training job's weights to the sampler (and to the log_prob job if configured), then
        drop the sampler's prefix cache where the server has ``/reset-prefix-cache`` (as the vendor's own
        client does: cached prompt prefixes were computed with the old weights)."""
        with self._training_call():
            out = self._recovery.call("weight sync", lambda _id: self._sync_weights_now(), safe=True)
            if Paths.RESET_PREFIX_CACHE in self._server_paths:
                sampling = self._job(JobType.SAMPLING)
                self._recovery.call(
                    f"POST {Paths.RESET_PREFIX_CACHE}",
                    lambda _id: self._http.post_json(Paths.RESET_PREFIX_CACHE, ResetPrefixCacheRequest().model_dump(),
                                                     params={"job_id": sampling}, op="weight_sync", idempotent=True),
                    safe=True)
            return out

    @functools.cached_property
    def _server_paths(self) -> frozenset[str]:
        """The routes the server lists in ``/openapi.json`` (empty when it lists none)."""
        spec = self._http.probe(Paths.OPENAPI, timeout_s=self.arctic.timeouts.connect_s + 10.0)
        paths = spec.get("paths") if isinstance(spec, dict) else None
        return frozenset(paths) if isinstance(paths, dict) else frozenset()

    def _sync_weights_now(self) -> dict:
        ws = self.arctic.weight_sync
        training, sampling = self._job(JobType.TRAINING), self._job(JobType.SAMPLING)
        if self.protocol is ProtocolVersion.V2:
            targets = [sampling] + ([self._job(JobType.LOG_PROB)] if ws.sync_log_prob else [])
            body = {"source_sub_job_id": training, "target_sub_job_ids": targets, "cuda_ipc": ws.cuda_ipc,
                    "low_memory": ws.low_memory}
            resp = self._http.post_json(Paths.WEIGHT_SYNC, body, params={"job_id": training}, op="weight_sync",
                                        idempotent=True)  # re-sending the same weights is harmless
        else:
            body = {"training_job_id": training, "sampling_job_id": sampling, "colocate": False,
                    "cuda_ipc": ws.cuda_ipc, "low_memory": ws.low_memory}
            resp = self._http.post_json(Paths.V1_SYNC_WEIGHTS, body, op="weight_sync", idempotent=True)
        return dict(resp.json())

    def save_checkpoint(self, step: int | None = None, *, path: str | None = None, export_hf: bool = False,
                        save_total_limit: int | None = None) -> dict:
        """Save model + optimizer + step on the server (``step`` names it; default: the server's step).

        Saving the same state twice is harmless, so an unanswered save is re-sent. A restart after
        this restores this checkpoint (and replays only what follows it)."""
        with self._training_call():
            if self.protocol is ProtocolVersion.V2:
                body: dict[str, Any] = {"export_hf": export_hf, "checkpoint_type": "resumable"}
                for key, value in (("step", step), ("path", path), ("save_total_limit", save_total_limit)):
                    if value is not None:
                        body[key] = value
                route = Paths.SAVE
            else:
                body, route = None, Paths.V1_SAVE_CHECKPOINT

            def send(request_id: str):
                return self._http.request("POST", route, op="save", params={"job_id": self._job(JobType.TRAINING)},
                                          json=body, idempotent=True, request_id=request_id)

            out = dict(self._recovery.call(f"POST {route}", send, safe=True).json())
            if self.protocol is ProtocolVersion.V2 and out.get("path"):
                saved = out.get("global_step")
                self._recovery.journal.reset(CheckpointRef(str(out["path"]), int(saved if saved is not None
                                                                                  else self._step)))
            return out

    def load_checkpoint(self, step: int | None = None, *, path: str | None = None, sync_weights: bool = True) -> dict:
        """Restore model + optimizer + step (v2 servers only), then refresh the sampler's weights."""
        if self.protocol is not ProtocolVersion.V2:
            raise RemoteProtocolError(Paths.LOAD_CHECKPOINT, "v1 servers cannot load checkpoints")
        body = {k: v for k, v in (("step", step), ("path", path)) if v is not None}
        with self._training_call():
            def send(request_id: str):  # loading the same state twice is harmless
                return self._http.request("POST", Paths.LOAD_CHECKPOINT, op="save", json=body, idempotent=True,
                                          params={"job_id": self._job(JobType.TRAINING)}, request_id=request_id)

            resp = self._recovery.call(f"POST {Paths.LOAD_CHECKPOINT}", send, safe=True)
            out = LoadCheckpointResponse.model_validate(resp.json())
            self._step = int(out.global_step)
            self._http.step = self._step
            self._recovery.journal.reset(CheckpointRef(str(out.path), self._step))
            if sync_weights:
                self.update_weights()
            return dict(resp.json())


def _tagged_bodies(verl: VerlSettings, arctic: ArcticConfig, tag: str | None) -> dict[JobType, dict]:
    bodies = {t: build_job_config(t, verl, arctic) for t in JOB_ORDER}
    if tag:
        for body in bodies.values():
            body["client_tag"] = tag  # ignored by servers that do not know it (JobConfig is tolerant)
    return bodies


def _tensor(tensors: dict, names: tuple[str, ...], endpoint: str) -> torch.Tensor:
    for name in names:
        value = tensors.get(name)
        if isinstance(value, torch.Tensor):
            return value.float()
    raise RemoteProtocolError(endpoint, f"the answer has no batch.{names[0]} tensor (keys: {sorted(tensors)})")
