"""The generic rollout replica: verl's generation served by a remote backend's sampler.

verl's agent loop asks a rollout *replica* for a server Ray actor and calls its
``generate(request_id, prompt_ids, sampling_params, ...)`` once per sample. Here:

* :class:`RemoteRolloutReplica` (a ``RolloutReplica``; ``register_backend`` registers it, or a
  backend's subclass of it, in verl's ``RolloutReplicaRegistry`` under the backend's name) launches
  one :class:`RemoteRolloutServer` actor (no CPU or GPU reserved) and links it to the forwarder
  worker, which tells it the weight version after every weight sync;
* the server re-attaches to the driver's backend and sends *token ids* to the backend's
  ``generate`` (:class:`~verl.remote_backend.protocols.RemoteSampler`). How depends on the backend's
  ``features`` (:func:`.dispatch.backend_features`; the names a server lists in ``/health``):

  - ``continuous_batching`` (the server takes calls into its running batch): each call goes as it comes, the
    ``rollout.n`` samples of one prompt as one request with ``n`` when the server also lists ``n_samples`` (not
    under ``rollout.full_determinism``: which samples share a request would depend on timing)
    (:mod:`.dispatch`, :mod:`.sample_groups`; at most ``remote_backend.rollout.max_batch_size`` requests in flight, a group
    waits at most ``max_wait_ms`` for its samples);
  - otherwise (the vendor's server): concurrent calls are coalesced into bounded batches, one row per sample
    (:mod:`.coalescer`; ``max_batch_size`` / ``max_wait_ms`` / ``max_in_flight``, read as the shared
    :class:`~verl.remote_backend.workers.batching.RolloutBatching`);
* :func:`normalize_sampling_params` maps verl's per-sample sampling parameters onto the
  backend-neutral dict every sampler takes; a backend's server subclass may refine it
  (:meth:`RemoteRolloutServer.convert_sampling_params`).

``sleep`` (verl's sync trainer calls it after each generation phase) puts the backend's sampler to sleep
when it declares :class:`~verl.remote_backend.protocols.SamplerSleep` and ``rollout.free_cache_engine`` is on;
the next ``generate`` wakes it first (:mod:`.sampler_sleep`). ``wake_up`` and the kv-cache verbs are no-ops.
Only the hybrid mode (one replica per forwarder worker) is supported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from verl.remote_backend.context import BackendContext, attach_backend, read_context
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.logs import module_logger
from verl.remote_backend.protocols import RemoteSampler, ReportsCallTimes, adopter_of, result_field
from verl.remote_backend.timings import BusyClock, CallTotals, CallWindow
from verl.remote_backend.workers.batching import RolloutBatching
from verl.remote_backend.workers.coalescer import RequestAborted, RequestCoalescer
from verl.remote_backend.workers.dispatch import rollout_dispatcher
from verl.remote_backend.workers.sample_groups import SampleGrouper
from verl.remote_backend.workers.sampler_sleep import SamplerNap, sleep_settings
from verl.remote_backend.workers.weight_fence import GenerationFence
from verl.remote_backend.workers.worker import attach_rollout_server

__all__ = ["RemoteRolloutReplica", "RemoteRolloutServer", "normalize_sampling_params", "remote_server_class"]

logger = module_logger(__name__)

# verl's penalties a remote sampler may lack, with their neutral values (dropped; warned once when not neutral)
_IGNORED_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
_warned: set[str] = set()


def normalize_sampling_params(
    params: Mapping[str, Any], *, prompt_len: int, response_length: int, prompt_length: int, backend: str = "remote"
) -> dict[str, Any]:
    """verl's per-sample ``sampling_params`` -> the backend-neutral dict a sampler's ``generate`` takes.

    * ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``ignore_eos``... pass through;
      ``top_k`` ``None``/``0`` mean disabled (-1);
    * ``logprobs`` (verl sends a bool) becomes ``True``/``None``;
    * ``max_tokens`` (or ``max_new_tokens``) defaults like verl's vLLM server:
      ``min(response_length, prompt_length + response_length - prompt_len)``, at least 1;
    * ``repetition_penalty`` and the other penalties are dropped with a one-time warning when not
      neutral. ``n`` must be 1 (one call per sample). The backend validates the rest.
    """
    raw: dict[str, Any] = {}
    for key, value in params.items():
        if key in _IGNORED_NEUTRAL:
            if value is not None and float(value) != _IGNORED_NEUTRAL[key] and key not in _warned:
                _warned.add(key)
                logger.warning("sampling param %s=%r is not supported by the %s sampler; ignored", key, value, backend)
            continue
        raw[key] = value
    n = raw.pop("n", 1)
    if n != 1:
        raise RemoteBackendConfigError("sampling_params.n", "the rollout server takes one sample per call", allowed=1, received=n)
    if raw.get("top_k") in (None, 0):
        raw["top_k"] = -1
    raw["logprobs"] = True if raw.get("logprobs") else None
    max_tokens = raw.pop("max_tokens", None)
    if max_tokens is None:
        max_tokens = raw.pop("max_new_tokens", None)
    raw.pop("max_new_tokens", None)
    if max_tokens is None:
        max_tokens = min(response_length, prompt_length + response_length - prompt_len)
    raw["max_tokens"] = max(1, int(max_tokens))
    return raw


def _stop_reason(finish_reason: str | None) -> str | None:
    if finish_reason in ("stop", "length"):
        return "completed"
    if finish_reason in ("abort", "aborted"):
        return "aborted"
    return finish_reason


class RemoteRolloutServer:
    """Ray actor behind one replica: verl's token-in/token-out server API over the backend's ``generate``.

    Args:
        context: the backend context dict (see :mod:`verl.remote_backend.context`).
        replica_rank: rank of the owning replica.
    """

    def __init__(self, context: dict, replica_rank: int = 0):
        self._context = BackendContext.from_mapping(context)
        self.replica_rank = replica_rank
        main = self._context.main_config_node()
        rollout = main.actor_rollout_ref.rollout
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.samples_per_prompt = max(1, int(rollout.get("n", 1) or 1)) if hasattr(rollout, "get") else 1
        self.deterministic = bool(rollout.get("full_determinism", False)) if hasattr(rollout, "get") else False
        self.batching = RolloutBatching.from_main_config(main)
        backend = attach_backend(self._context)
        if not isinstance(backend, RemoteSampler):
            raise RemoteBackendConfigError(
                "remote_backend.name", f"backend {type(backend).__name__} has no generate()",
                allowed="a backend implementing verl.remote_backend.protocols.RemoteSampler", received=self._context.name,
            )
        self._backend: RemoteSampler = backend
        self._coalescer: RequestCoalescer | SampleGrouper | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.global_steps = 0
        self._admit = asyncio.Event()  # closed between abort_all_requests and resume_generation
        self._admit.set()
        self._reject = False
        self.batches = 0
        self.samples = 0
        self._busy = BusyClock()  # the time the backend had at least one of this server's calls
        self._window = CallWindow()  # when verl's first call arrived and its last was answered (the trainer asks)
        enabled, why = sleep_settings(main)
        self.nap = SamplerNap(backend, enabled=enabled, why=why)
        self.fence = GenerationFence()

    async def ready(self) -> bool:
        """Answer once the actor is constructed (and attached)."""
        return True

    def _coalescer_for_loop(self) -> RequestCoalescer | SampleGrouper:
        if self._coalescer is None:
            self._coalescer = rollout_dispatcher(self._backend, self.batching, samples_per_prompt=self.samples_per_prompt,
                                                 run_batch=self._generate_batch, run_group=self._generate_group,
                                                 deterministic=self.deterministic)
            if isinstance(self._coalescer, SampleGrouper):
                self._executor = ThreadPoolExecutor(self.batching.max_batch_size, thread_name_prefix="generate")
        return self._coalescer

    async def _generate_batch(self, prompts: list[list[int]], params: dict[str, Any]) -> Sequence[Any]:
        start = time.monotonic()
        self._busy.begin()
        try:
            results = await asyncio.to_thread(self._backend.generate, prompts, params)
        finally:
            self._busy.end()
        self.batches += 1
        self.samples += len(prompts)
        logger.debug("generate: %d prompts in %.2f s", len(prompts), time.monotonic() - start)
        return results

    async def _generate_group(self, prompt: list[int], params: dict[str, Any]) -> Sequence[Any]:
        """``params.get("n", 1)`` samples of one prompt, in a thread of the server's own pool (many at once)."""
        self._busy.begin()
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, self._backend.generate,
                                                                       [prompt], params)
        finally:
            self._busy.end()
        self.batches += 1
        self.samples += int(params.get("n", 1))
        return results

    def convert_sampling_params(self, params: Mapping[str, Any], prompt_len: int) -> dict[str, Any]:
        """verl's per-sample parameters -> what the backend's ``generate`` takes (override to refine)."""
        return normalize_sampling_params(params, prompt_len=prompt_len, response_length=self.response_length,
                                         prompt_length=self.prompt_length, backend=self._context.name)

    def _aborted(self) -> TokenOutput:
        return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields={"global_steps": self.global_steps})

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Generate one sample for ``prompt_ids`` (token ids in, token ids out)."""
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise RemoteBackendConfigError("generate.image_data/video_data", f"multimodal prompts are not supported by the {self._context.name} rollout", received="multimodal data")
        self._window.arrived()
        if not self._admit.is_set():
            if self._reject:
                return self._aborted()
            await self._admit.wait()
        prompt = [int(t) for t in prompt_ids]
        params = self.convert_sampling_params(sampling_params, len(prompt))
        async with self.fence.admitted():  # held while a fenced weight sync runs (asynchronous mode)
            sent_at_version = self.global_steps  # a weight sync may land before the answer (asynchronous mode)
            await self.nap.ensure_awake()
            try:
                result = await self._coalescer_for_loop().submit(prompt, params)
            except RequestAborted:
                return self._aborted()
        logprobs = result_field(result, "logprobs")
        log_probs = [float(x) for x in logprobs] if params.get("logprobs") and logprobs is not None else None
        self._window.answered()
        return TokenOutput(
            token_ids=[int(t) for t in result_field(result, "token_ids")],
            log_probs=log_probs,
            stop_reason=_stop_reason(result_field(result, "finish_reason")),
            extra_fields={"global_steps": self.global_steps, "min_global_steps": sent_at_version},
        )

    # ---------------------------------------------------------------- verl's control verbs
    async def adopt_sampler(self, data: Mapping[str, Any]) -> None:
        """Hand the actor side's sampler update (``update_weights``) to this process's backend."""
        adopter = adopter_of(self._backend)
        if adopter is None:
            raise RemoteBackendConfigError(
                "remote_backend.name", f"backend {type(self._backend).__name__} returned a sampler update but does "
                "not declare SamplerAdopter", allowed="a backend implementing verl.remote_backend.protocols."
                "SamplerAdopter (adopt_sampler)", received=self._context.name,
            )
        await asyncio.to_thread(adopter.adopt_sampler, data)

    async def hold_generation(self) -> int:
        """Admit no new call and wait for those in flight (a fenced weight sync, :mod:`.weight_fence`)."""
        return await self.fence.hold()

    async def release_generation(self) -> None:
        self.fence.release()

    async def set_global_steps(self, global_steps: int) -> None:
        """Weight version of the sampler (set by the worker after each weight sync)."""
        self.global_steps = int(global_steps)

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Drop queued (unsent) calls; hold new ones until :meth:`resume_generation` (or answer
        them as aborted when ``reject_request``). Batches already sent run to completion."""
        self._reject = bool(reject_request)
        self._admit.clear()
        aborted = self._coalescer.abort_pending("abort_all_requests") if self._coalescer else 0
        return {"aborted": aborted}

    async def resume_generation(self) -> None:
        self._reject = False
        self._admit.set()

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        return None  # the next generate wakes the sampler (the weight sync restores what it needs itself)

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """After a generation phase (sync mode): the sampler's sleep starts where enabled and supported; the call
        does not wait for it (the next ``generate`` does: :mod:`.sampler_sleep`)."""
        await self.nap.sleep()

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    def get_address(self) -> str:
        """A label for verl's load balancer (``host:port`` of the backend when known)."""
        url = str((self._context.handle or {}).get("url") or "")
        host_port = url.split("://", 1)[-1].rstrip("/")
        return f"{host_port or self._context.name}#replica{self.replica_rank}"

    def collect_generation_timings(self) -> dict[str, float]:
        """Since the last collect: ``gen/backend_busy``, the seconds during which the backend had at least one of
        this server's calls (overlapping calls counted once), ``gen/backend_calls``, and where the backend reports
        its calls' times (:class:`~verl.remote_backend.protocols.ReportsCallTimes`) ``gen/http_sum`` and
        ``gen/server_sum``: the calls' wall and server seconds added up (above the busy time when calls overlap);
        where the sampler sleeps between phases, ``gen/sampler_sleep`` and ``gen/sampler_wake`` (seconds)."""
        busy_s, calls = self._busy.collect()
        out = {"gen/backend_busy": busy_s, "gen/backend_calls": float(calls), **self.nap.collect()}
        if isinstance(self._backend, ReportsCallTimes):
            totals = CallTotals.from_mapping(self._backend.drain_call_times())
            out["gen/http_sum"] = totals.wall_s
            if totals.server_reported:
                out["gen/server_sum"] = totals.server_s
        return out

    def drain_call_window(self) -> dict[str, float]:
        """Since the last drain: when the first of verl's calls reached this server and when the last was answered
        (wall clock; :class:`~verl.remote_backend.timings.CallWindow`). The trainer drains it before it hands a batch
        over and when the samples are back, and sets both against its own stamps."""
        return self._window.drain()

    def stats(self) -> dict[str, int]:
        """Batches and samples sent so far (for logs and tests)."""
        return {"batches": self.batches, "samples": self.samples, "global_steps": self.global_steps}


_REMOTE_CLASSES: dict[type, Any] = {}


def remote_server_class(server_cls: type[RemoteRolloutServer]) -> Any:
    """``ray.remote(num_cpus=0)(server_cls)``, made once per class."""
    if server_cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[server_cls] = ray.remote(num_cpus=0)(server_cls)
    return _REMOTE_CLASSES[server_cls]


class RemoteRolloutReplica(RolloutReplica):
    """verl rollout replica whose server forwards generation to the remote backend's sampler.

    A backend's subclass may set :attr:`server_class` to a :class:`RemoteRolloutServer` subclass.
    """

    #: the Ray actor class launched per replica (wrapped with ``ray.remote(num_cpus=0)``)
    server_class: type[RemoteRolloutServer] = RemoteRolloutServer

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Start the server actor, wait until it is attached, and link it to the worker(s)."""
        if not self.workers:
            raise RemoteBackendConfigError(
                "actor_rollout_ref.rollout.name",
                "a remote-backend rollout runs in hybrid mode only (one replica per forwarder worker); "
                "it has no worker group to attach to",
                received=getattr(self.rollout_mode, "value", self.rollout_mode),
            )
        context = read_context(self.config)
        name = f"{context.name}_rollout_server_{self.replica_rank}{self.name_suffix}"
        server = remote_server_class(self.server_class).options(name=name, max_concurrency=self.max_concurrency).remote(
            context=context.to_dict(), replica_rank=self.replica_rank
        )
        await server.ready.remote()
        linked = await asyncio.gather(*[w.__ray_call__.remote(attach_rollout_server, server) for w in self.workers])
        if sum(linked) == 0:
            raise RemoteBackendConfigError(
                "actor_rollout_ref.rollout.name",
                "a remote-backend rollout needs a RemoteActorRolloutRefWorker as actor worker (run through the "
                "remote-backend trainer)",
                received="another worker class",
            )
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.get_address.remote()

    async def init_standalone(self) -> None:
        raise NotImplementedError("a remote-backend rollout has no standalone mode: the remote backend owns the sampler")

    async def init_colocated(self, resource_pool: Any) -> None:
        raise NotImplementedError("a remote-backend rollout has no colocated mode: the remote backend owns the sampler")
