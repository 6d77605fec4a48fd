"""The checkpoint and weight-sync role of the Arctic adapter.

* ``update_weights``: the training job's weights to the sampler (and to the log_prob job if
  configured), then ``/reset-prefix-cache`` on the sampler where the server has it -- as the vendor's
  own client does: cached prompt prefixes were computed with the old weights.
* ``save_checkpoint`` / ``load_checkpoint``: model + optimizer + step on the server. A save on a
  server that can load it back becomes the base a restore starts from (the journal is reset to it).

Routes and bodies come from the run's :class:`~.dialect.Dialect`; every call is harmless to repeat,
so an unanswered one is re-sent (:meth:`~.recovery.Recovery.call`). Answers are read through their models
(:class:`~arctic_rl.protocol.WeightSyncResponse`, :class:`~arctic_rl.protocol.SaveResponse`,
:class:`~arctic_rl.protocol.LoadCheckpointResponse`). A save or load that can anchor a restore is told
to :meth:`~.recovery.Recovery.anchor`. What is not here: recovery checkpoints' schedule
(:mod:`.checkpoint_schedule`).
"""

from __future__ import annotations

import functools

from arctic_rl.protocol import (
    JobType,
    LoadCheckpointResponse,
    Paths,
    ResetPrefixCacheRequest,
    SaveResponse,
    WeightSyncResponse,
)

from .answers import parse_answer
from .arctic_config import ArcticConfig
from .dialect import Payload
from .recovery import Recovery
from .request import JobRequest, WeightSync
from .session import JobCalls
from .state import RunState

__all__ = ["Checkpoints", "weight_sync_request"]


def weight_sync_request(arctic: ArcticConfig) -> JobRequest:
    """The weight sync between the run's current jobs (addressed afresh at each send: a restore changes them)."""
    ws = arctic.weight_sync
    return JobRequest("POST", "weight sync", op="weight_sync", idempotent=True,
                      weight_sync=WeightSync(to_log_prob=ws.sync_log_prob, cuda_ipc=ws.cuda_ipc,
                                             low_memory=ws.low_memory))


class Checkpoints:
    """Weight sync and checkpoints of the training job (see the module docstring)."""

    def __init__(self, calls: JobCalls, state: RunState, recovery: Recovery, *, arctic: ArcticConfig,
                 weight_sync: JobRequest) -> None:
        self.calls = calls
        self.state = state
        self.recovery = recovery
        self.arctic = arctic
        self._sync = weight_sync

    def update_weights(self) -> dict:
        """Push the weights, then drop the sampler's prefix cache where the server can."""
        with self.recovery.training_call():
            out = self.calls.read(self._sync, WeightSyncResponse).answer(self._sync.what)
            self.recovery.sampler_synced()
            if Paths.RESET_PREFIX_CACHE in self.server_paths:
                body = ResetPrefixCacheRequest().model_dump(mode="json")
                self.calls.call(JobRequest("POST", Paths.RESET_PREFIX_CACHE, op="weight_sync", idempotent=True,
                                           job=JobType.SAMPLING, payload=Payload(json=body)))
            return out.model_dump()

    @functools.cached_property
    def server_paths(self) -> frozenset[str]:
        """The routes the server lists in ``/openapi.json`` (empty when it lists none)."""
        spec = self.state.http.probe(Paths.OPENAPI, timeout_s=self.arctic.timeouts.connect_s + 10.0)
        paths = spec.get("paths") if isinstance(spec, dict) else None
        return frozenset(paths) if isinstance(paths, dict) else frozenset()

    def save_checkpoint(self, step: int | None = None, *, path: str | None = None, export_hf: bool = False,
                        save_total_limit: int | None = None) -> dict:
        """Save model + optimizer + step on the server (``step`` names it; default: the server's step)."""
        state = self.state
        with self.recovery.training_call():
            route = state.dialect.save(step=step, path=path, export_hf=export_hf, save_total_limit=save_total_limit)
            what = f"POST {route.path}"
            out = self.calls.post(route.path, JobType.TRAINING, Payload(json=route.body), op="save",
                                  idempotent=True).answer(what)
            if state.dialect.can_load_checkpoints:  # only a save that can be loaded back anchors a restore
                saved = parse_answer(SaveResponse, out, what)
                step_saved = saved.global_step if saved.global_step is not None else state.step
                self.recovery.anchor(str(saved.path), int(step_saved), saved=True)
            return dict(out)

    def load_checkpoint(self, step: int | None = None, *, path: str | None = None, sync_weights: bool = True) -> dict:
        """Restore model + optimizer + step (servers that can), then refresh the sampler's weights."""
        state = self.state
        body = state.dialect.load_checkpoint_body(step=step, path=path)  # raises where checkpoints cannot load
        request = JobRequest("POST", Paths.LOAD_CHECKPOINT, op="save", idempotent=True, job=JobType.TRAINING,
                             payload=Payload(json=body))
        with self.recovery.training_call():
            loaded = self.calls.read(request, LoadCheckpointResponse).answer(request.what)
            state.set_step(loaded.global_step)
            self.recovery.anchor(str(loaded.path), state.step)
            if sync_weights:
                self.update_weights()
            return loaded.model_dump()
