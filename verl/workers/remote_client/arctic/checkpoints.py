"""The checkpoint and weight-sync role of the Arctic adapter.

* ``update_weights``: the training job's weights to the sampler (and to the log_prob job if
  configured), then ``/reset-prefix-cache`` on the sampler where the server has it -- as the vendor's
  own client does: cached prompt prefixes were computed with the old weights.
* ``save_checkpoint`` / ``load_checkpoint``: model + optimizer + step on the server. A save on a
  server that can load it back becomes the base a restore starts from (the journal is reset to it).

Routes and bodies come from the run's :class:`~.dialect.Dialect`; every call is harmless to repeat,
so an unanswered one is re-sent. What is not here: recovery checkpoints' schedule (:mod:`.recovery`).
"""

from __future__ import annotations

import functools
from typing import Any

from arctic_rl.protocol import JobType, LoadCheckpointResponse, Paths, ResetPrefixCacheRequest, SaveResponse
from verl.remote_backend.errors import RemoteProtocolError

from .answers import parse_answer
from .arctic_config import ArcticConfig
from .journal import CheckpointRef
from .session import JobCalls

__all__ = ["Checkpoints"]


class Checkpoints:
    """Weight sync and checkpoints of the training job (see the module docstring)."""

    def __init__(self, calls: JobCalls, *, arctic: ArcticConfig) -> None:
        self.calls = calls
        self.state = calls.state
        self.recovery = calls.recovery
        self.arctic = arctic

    def update_weights(self) -> dict:
        """Push the weights, then drop the sampler's prefix cache where the server can."""
        state = self.state
        with self.calls.training_call():
            out = self.recovery.call("weight sync", lambda _id: self.sync_weights_now(), safe=True)
            if Paths.RESET_PREFIX_CACHE in self.server_paths:
                sampling = state.job(JobType.SAMPLING)
                body = ResetPrefixCacheRequest().model_dump(mode="json")
                self.recovery.call(
                    f"POST {Paths.RESET_PREFIX_CACHE}",
                    lambda _id: state.http.post_json(Paths.RESET_PREFIX_CACHE, body, params={"job_id": sampling},
                                                     op="weight_sync", idempotent=True),
                    safe=True)
            return out

    @functools.cached_property
    def server_paths(self) -> frozenset[str]:
        """The routes the server lists in ``/openapi.json`` (empty when it lists none)."""
        spec = self.state.http.probe(Paths.OPENAPI, timeout_s=self.arctic.timeouts.connect_s + 10.0)
        paths = spec.get("paths") if isinstance(spec, dict) else None
        return frozenset(paths) if isinstance(paths, dict) else frozenset()

    def sync_weights_now(self) -> dict:
        """One weight-sync call (no retry around it: :class:`~.recovery.Recovery` calls this too)."""
        state, ws = self.state, self.arctic.weight_sync
        route = state.dialect.weight_sync(
            training=state.job(JobType.TRAINING), sampling=state.job(JobType.SAMPLING),
            log_prob=state.job(JobType.LOG_PROB) if ws.sync_log_prob else None, cuda_ipc=ws.cuda_ipc,
            low_memory=ws.low_memory)
        resp = state.http.post_json(route.path, route.body, params=route.params, op="weight_sync",
                                    idempotent=True)  # re-sending the same weights is harmless
        return dict(resp.json())

    def save_checkpoint(self, step: int | None = None, *, path: str | None = None, export_hf: bool = False,
                        save_total_limit: int | None = None) -> dict:
        """Save model + optimizer + step on the server (``step`` names it; default: the server's step)."""
        state = self.state
        with self.calls.training_call():
            route = state.dialect.save(step=step, path=path, export_hf=export_hf, save_total_limit=save_total_limit)

            def send(request_id: str):
                return state.http.request("POST", route.path, op="save", params={"job_id": state.job(JobType.TRAINING)},
                                          json=route.body, idempotent=True, request_id=request_id)

            out = dict(self.recovery.call(f"POST {route.path}", send, safe=True).json())
            if state.dialect.can_load_checkpoints and out.get("path"):
                saved = parse_answer(SaveResponse, out, f"POST {route.path}")
                step_saved = saved.global_step if saved.global_step is not None else state.step
                self.recovery.journal.reset(CheckpointRef(str(saved.path), int(step_saved)))
            return out

    def load_checkpoint(self, step: int | None = None, *, path: str | None = None, sync_weights: bool = True) -> dict:
        """Restore model + optimizer + step (servers that can), then refresh the sampler's weights."""
        state = self.state
        if not state.dialect.can_load_checkpoints:
            raise RemoteProtocolError(Paths.LOAD_CHECKPOINT, f"v{int(state.dialect.version)} servers cannot load "
                                      "checkpoints")
        body: dict[str, Any] = state.dialect.load_checkpoint_body(step=step, path=path)
        with self.calls.training_call():
            def send(request_id: str):  # loading the same state twice is harmless
                return state.http.request("POST", Paths.LOAD_CHECKPOINT, op="save", json=body, idempotent=True,
                                          params={"job_id": state.job(JobType.TRAINING)}, request_id=request_id)

            resp = self.recovery.call(f"POST {Paths.LOAD_CHECKPOINT}", send, safe=True)
            out = parse_answer(LoadCheckpointResponse, resp.json(), f"POST {Paths.LOAD_CHECKPOINT}")
            state.set_step(out.global_step)
            self.recovery.journal.reset(CheckpointRef(str(out.path), state.step))
            if sync_weights:
                self.update_weights()
            return dict(resp.json())
