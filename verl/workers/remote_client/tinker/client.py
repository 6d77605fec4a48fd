"""``TinkerClient``: the ``tinker`` remote backend (a LoRA run on a Tinker training API).

Registered as ``remote_backend=tinker``. It implements the lifecycle ABC and both compute
protocols (:mod:`verl.remote_backend.protocols`) on the official SDK (:mod:`.sdk`):

* old log-probs: the training client's ``forward`` (``cross_entropy`` outputs) on the current
  weights; reference log-probs: ``compute_logprobs`` of a base-model sampling client;
* ``update_actor``: per mini-batch one ``forward_backward`` with the built-in ``ppo`` (or
  ``importance_sampling``) loss, advantages scaled for verl's ``loss_agg_mode``, then one
  ``optim_step`` with verl's Adam settings and scheduled learning rate;
* weight sync: ``save_weights_for_sampler``; the path goes to the rollout server's process
  (``update_weights`` -> ``adopt_sampler``), which opens a sampling client on it;
* ``generate``: ``SamplingClient.sample`` from token ids, identical prompts of a batch folded
  into one call with ``num_samples``;
* checkpoints: ``save_state`` / ``load_state_with_optimizer``, with a step -> path index file
  that verl's resume reads (:mod:`.checkpoints`).

Which process owns what: the SDK cannot hand a training client to another process, so the
driver's instance only validates the run and checks the service (its handle names the service
and base model); the one forwarder worker creates the LoRA training run on its first actor call,
and each rollout server opens its own sampling clients. ``destroy`` drops what the instance
created; the service frees a run whose session stops heartbeating.
"""

from __future__ import annotations

import atexit
import random
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from tensordict import TensorDict

from verl.remote_backend.base import RemoteBackend
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.logs import module_logger
from verl.remote_backend.protocols import SAMPLER_UPDATE_KEY, SamplerAdopter
from verl.remote_backend.strict_config import select
from verl.workers.remote_client.tinker import batch as tb
from verl.workers.remote_client.tinker.checkpoints import StateIndex
from verl.workers.remote_client.tinker.config import TinkerConfig
from verl.workers.remote_client.tinker.options import TinkerRun, learning_rate, plan_run
from verl.workers.remote_client.tinker.sampling import SamplerSide
from verl.workers.remote_client.tinker.sdk import TinkerSession, full_length_logprobs, untested_sdk_line, wait

__all__ = ["TinkerClient"]

logger = module_logger(__name__)


class TinkerClient(RemoteBackend, SamplerAdopter):
    """The Tinker adapter; construct with :meth:`from_config`."""

    #: what ``remote_backend.server.url: null`` means (the preflight check's hint)
    null_url_means = "use the SDK's default service"

    def __init__(self, *, tinker: TinkerConfig, run: TinkerRun, session: TinkerSession, handle: dict,
                 index: StateIndex):
        self.tinker = tinker
        self.run = run
        self.session = session
        self.handle = handle
        self.index = index
        self.sampler = SamplerSide(session, run.base_model, eos_from=run.model_path)
        self._tc: Any = None
        self._reference: Any = None
        self._lock = threading.RLock()
        self._step = 0  # trainer steps done (the learning-rate schedule's index)
        self._syncs = 0
        self._destroyed = False
        atexit.register(self.destroy)

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict | None = None) -> TinkerClient:
        tinker = TinkerConfig.from_main_config(main_config)
        run = plan_run(main_config, tinker)
        session = TinkerSession(tinker.server.url, call_timeout_s=tinker.timeouts.call_s)
        index_dir = tinker.checkpoint.index_dir or select(main_config, "trainer.default_local_dir", None)
        index = StateIndex(index_dir)
        if handle is None:
            models = session.supported_models()
            if models and run.base_model not in models:
                raise RemoteBackendConfigError(
                    "remote_backend.server.base_model", "the service does not offer this base model (null uses "
                    "actor_rollout_ref.model.path)", allowed=models, received=run.base_model)
            handle = {"url": tinker.server.url, "base_model": run.base_model, "run": uuid.uuid4().hex[:12],
                      "sdk": session.version}
            logger.info("tinker backend: %s, base model %s, LoRA rank %d, SDK %s",
                        tinker.server.url or "the SDK's default service", run.base_model, run.lora_rank,
                        session.version)
            note = untested_sdk_line(session.version)
            if note is not None:
                logger.warning(note)
        return cls(tinker=tinker, run=run, session=session, handle=dict(handle), index=index)

    def reconnect_handle(self) -> dict:
        return dict(self.handle)

    def requires_single_forwarder(self) -> bool:
        return True  # the LoRA run lives in exactly one process (the SDK cannot share a training client)

    def concurrent_jobs(self) -> tuple[bool, str]:
        """For the asynchronous mode (verl/remote_backend/async_trainer.py): the rollout server's sampling client
        and the worker's training client are separate SDK clients whose calls are futures, so a sample is answered
        while a training call runs; an adopted sampler serves the calls sent after it."""
        return True, "Tinker's sampling and training clients are separate SDK clients (futures)"

    def weight_sync_keeps_answers_whole(self) -> tuple[bool, str]:
        """A sample call is bound to the sampling client of one saved weight path; adopting a new path serves the
        calls sent after it and leaves those in flight on theirs."""
        return True, "each Tinker sample call is bound to the sampling client of one saved weight path"

    def destroy(self) -> None:
        """Drop the training and sampling clients this instance created (idempotent)."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
            self._tc = None
            self._reference = None
            self.sampler.close()
        atexit.unregister(self.destroy)

    # ------------------------------------------------------------------ training client
    @property
    def training_client(self) -> Any:
        """The LoRA training run, created on first use (or restored from ``checkpoint.load_path``)."""
        with self._lock:
            if self._destroyed:
                raise RemoteBackendConfigError("remote_backend", "the Tinker backend was destroyed",
                                               received="a call after destroy()")
            if self._tc is None:
                t = self.tinker.train
                self._tc = self.session.create_training_client(
                    self.run.base_model, rank=self.run.lora_rank, seed=self.run.seed, train_mlp=t.train_mlp,
                    train_attn=t.train_attn, train_unembed=t.train_unembed)
                if self.tinker.checkpoint.load_path:
                    self.session.load_state(self._tc, self.tinker.checkpoint.load_path)
                logger.info("tinker LoRA run created (rank %d)", self.run.lora_rank)
            return self._tc

    @property
    def step(self) -> int:
        return self._step

    # ------------------------------------------------------------------ RemoteActor
    @classmethod
    def tensor_fields_read(cls, method: str) -> frozenset[str] | None:
        """The fields of verl's batch each compute method may read (``ReadsTensorFields``): the rows' tokens and
        lengths, and for ``update_actor`` the response-shaped RL tensors too."""
        if method in ("compute_log_prob", "compute_ref_log_prob"):
            return frozenset(tb.ROW_KEYS)
        if method == "update_actor":
            return frozenset(tb.ROW_KEYS + tb.UPDATE_KEYS)
        return None

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs under the current training weights (``forward``); entropy as ``-log p``.

        With verl's ``no_lora_adapter`` flag (how verl asks a LoRA actor for reference log-probs)
        this is :meth:`compute_ref_log_prob`."""
        from verl.utils import tensordict_utils as tu

        if bool(tu.get(data, "no_lora_adapter", False)):
            return self.compute_ref_log_prob(data)
        rows = tb.split_rows(data)
        datums = [self.session.datum(*tb.target_inputs(rows, b, {"weights": [1.0] * rows.response_lens[b]}))
                  for b in range(len(rows))]
        with self._lock:
            per_target = self.session.forward(self.training_client, datums)
        log_probs = tb.nested_like(per_target, rows)
        result = {"log_probs": log_probs}
        if bool(tu.get(data, "calculate_entropy", False)):
            result["entropy"] = tb.nested_like([[-x for x in row] for row in per_target], rows)
        return tu.get_tensordict(result, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        """Log-probs of the base model (``compute_logprobs`` of a base-model sampling client)."""
        from verl.utils import tensordict_utils as tu

        rows = tb.split_rows(data)
        with self._lock:
            if self._reference is None:
                self._reference = self.session.sampling_client(base_model=self.run.base_model)
            reference = self._reference
        futures = [self.session.compute_logprobs(reference, tokens) for tokens in rows.tokens]
        per_target = []
        for tokens, future in zip(rows.tokens, futures):
            values = full_length_logprobs(wait(future, self.session.timeout_s, "compute_logprobs"), len(tokens),
                                          "compute_logprobs")
            per_target.append([float(v) for v in values[1:]])
        return tu.get_tensordict({"log_probs": tb.nested_like(per_target, rows)},
                                 non_tensor_dict={"metrics": {"mfu": 0.0}})

    def update_actor(self, data: TensorDict) -> TensorDict:
        """``epochs`` x mini-batches of (``forward_backward``, ``optim_step``); verl's metrics back."""
        from verl.utils import tensordict_utils as tu

        run = self.run
        mini = int(tu.get(data, "global_batch_size", None) or run.mini_batch_rows)
        epochs = int(tu.get(data, "epochs", None) or run.epochs)
        seed = tu.get(data, "seed", None)
        seed = run.data_seed if seed is None else int(seed)
        rows = tb.split_rows(data)
        if len(rows) % mini:
            raise RemoteBackendConfigError(
                "actor_rollout_ref.actor.ppo_mini_batch_size", f"a batch of {len(rows)} rows does not split into "
                f"mini-batches of {mini} rows (ppo_mini_batch_size x rollout.n)", allowed=f"a multiple of {mini}",
                received=len(rows))
        mask = tb.response_values(data, "response_mask", rows)
        old = tb.response_values(data, "old_log_probs", rows)
        adv = tb.response_values(data, "advantages", rows)
        if "rollout_is_weights" in data.keys():  # noqa: SIM118 (TensorDict has no __contains__)
            weights = tb.response_values(data, "rollout_is_weights", rows)
            adv = [[a * w for a, w in zip(ra, rw)] for ra, rw in zip(adv, weights)]
        lr = learning_rate(run, self._step)
        out: dict[str, list[float]] = {}
        with self._lock:
            tc = self.training_client
            for epoch in range(epochs):
                order = list(range(len(rows)))
                if run.shuffle:
                    random.Random(seed + epoch).shuffle(order)
                for start in range(0, len(order), mini):
                    idx = order[start : start + mini]
                    scales = tb.row_scales([mask[b] for b in idx], run.loss_agg_mode, run.loss_scale_factor)
                    datums = []
                    for b, scale in zip(idx, scales):
                        a = [x * m * scale for x, m in zip(adv[b], mask[b])]
                        datums.append(self.session.datum(*tb.target_inputs(rows, b, {"logprobs": old[b],
                                                                                       "advantages": a})))
                    new, _fb_metrics = self.session.forward_backward(tc, datums, run.loss_fn, run.loss_fn_config)
                    opt = self.session.optim_step(tc, lr=lr, betas=run.optim.betas, eps=run.adam_eps,
                                                  weight_decay=run.optim.weight_decay,
                                                  grad_clip_norm=run.optim.clip_grad)
                    values = _mini_batch_metrics(rows, idx, mask, old, adv, new, scales, run)
                    values.update(_optim_metrics(opt, lr))
                    for name, value in values.items():
                        out.setdefault(name, []).append(value)
            self._step += 1
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": out})

    def update_weights(self) -> dict:
        """Save the LoRA weights for sampling; the path reaches the rollout servers' processes."""
        with self._lock:
            self._syncs += 1
            name = f"{self.handle.get('run', 'run')}-step{self._step}-sync{self._syncs}"
            path = self.session.save_for_sampler(self.training_client, name)
        self.sampler.adopt(path)
        return {SAMPLER_UPDATE_KEY: {"model_path": path}, "step": self._step}

    def save_checkpoint(self, step: int | None = None) -> dict:
        """``save_state`` (weights + optimizer) named after verl's global step; indexed for resume."""
        step = self._step if step is None else int(step)
        with self._lock:
            path = self.session.save_state(self.training_client, f"{self.handle.get('run', 'run')}-step{step}")
        self.index.record(step, path)
        return {"path": path, "global_step": step}

    def load_checkpoint(self, step: int | None = None, *, path: str | None = None) -> dict:
        """Restore the state saved for ``step`` (from the index) or ``path``; then sync the sampler."""
        if path is None:
            path = self.index.lookup(step)
        with self._lock:
            self.session.load_state(self.training_client, path)
            if step is not None:
                self._step = int(step)
        self.update_weights()
        return {"path": path, "global_step": self._step}

    # ------------------------------------------------------------------ RemoteSampler
    def generate(self, prompts: list[list[int]], sampling_params: dict | None = None) -> list[dict]:
        return self.sampler.generate(prompts, sampling_params or {})

    def adopt_sampler(self, data: Mapping[str, Any]) -> None:
        """The worker's ``update_weights`` result: sample from ``data['model_path']`` from now on."""
        self.sampler.adopt(str(data["model_path"]))


def _mini_batch_metrics(rows: tb.Rows, idx: list[int], mask: list[list[float]], old: list[list[float]],
                        adv: list[list[float]], new: list[list[float]], scales: list[float],
                        run: TinkerRun) -> dict[str, float]:
    """verl's actor metrics of one mini-batch, from the log-probs ``forward_backward`` returned."""
    import math

    low = run.loss_fn_config["clip_low_threshold"] if run.loss_fn_config else None
    high = run.loss_fn_config["clip_high_threshold"] if run.loss_fn_config else None
    loss = kl = clipped = tokens = 0.0
    for j, b in enumerate(idx):
        start = rows.prompt_lens[b] - 1
        for k, m in enumerate(mask[b]):
            if not m:
                continue
            lp_new = new[j][start + k]
            ratio = math.exp(lp_new - old[b][k])
            a = adv[b][k] * scales[j]
            if low is None:
                loss += -ratio * a
            else:
                clipped_ratio = min(max(ratio, low), high)
                loss += -min(ratio * a, clipped_ratio * a)
                clipped += float(clipped_ratio != ratio)
            kl += old[b][k] - lp_new
            tokens += 1
    n = max(tokens, 1.0)
    return {"pg_loss": loss, "ppo_kl": kl / n, "pg_clipfrac": clipped / n, "mfu": 0.0}


def _optim_metrics(metrics: dict[str, float], lr: float) -> dict[str, float]:
    out = {"lr": lr}
    for key, value in metrics.items():
        if key.endswith("grad_norm"):
            out["grad_norm"] = value
    return out
