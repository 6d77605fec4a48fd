"""The contract kit: check a remote backend the way verl will use it, statically and on a fake batch.

A backend -- ours or a third vendor's, in its own CI -- runs two checks:

* :func:`check_backend_class` -- no service needed: the class is a concrete
  :class:`~verl.remote_backend.base.RemoteBackend` (the lifecycle), offers the compute Protocols
  :class:`~verl.remote_backend.protocols.RemoteActor` and :class:`~verl.remote_backend.protocols.RemoteSampler`,
  every method takes the arguments verl passes, and an optional capability it has is declared as its
  Protocol (:class:`~verl.remote_backend.protocols.SamplerAdopter`);
* :func:`run_contract` -- against a live backend: every method called once, in the order a GRPO step
  calls them, on a verl-0.9.1-shaped batch from :func:`fake_batch` (nested ``input_ids``, response-padded
  RL tensors, the non-tensor keys verl's trainer sets), and each answer checked: log-probs nested like
  ``input_ids``, finite and at most 0; one metric value per mini-batch from ``update_actor``; ``n``
  samples per prompt from ``generate``; JSON data from ``reconnect_handle`` and the checkpoints. A backend that
  declares the tensor fields each compute method reads (``ReadsTensorFields``) gets the batch narrowed to them,
  as the forwarder hands it over, and its log-probs must equal those of the whole batch.

A failed check raises :class:`ContractError` naming the method and what came back. Usage::

    from verl.remote_backend.contract import check_backend_class, run_contract

    check_backend_class(AcmeClient)
    backend = AcmeClient.from_config(main_config)
    try:
        print(run_contract(backend, main_config))
    finally:
        backend.destroy()
"""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl.remote_backend.base import RemoteBackend
from verl.remote_backend.protocols import (
    ACTOR_METHODS,
    COMPUTE_METHODS,
    SAMPLER_METHODS,
    RemoteActor,
    RemoteSampler,
    SamplerAdopter,
    fields_read,
    result_field,
)

__all__ = ["LIFECYCLE_METHODS", "ContractError", "ContractReport", "as_read",
           "check_backend_class", "fake_batch", "run_contract"]

#: the lifecycle methods of the ABC (every one abstract: a backend declares each)
LIFECYCLE_METHODS = tuple(sorted(RemoteBackend.__abstractmethods__))
#: finish reasons a sample may report
FINISH_REASONS = ("stop", "length", "abort", None)


class ContractError(AssertionError):
    """A backend broke the contract: ``method`` and what is wrong."""

    def __init__(self, method: str, problem: str) -> None:
        super().__init__(f"{method}: {problem}")
        self.method = method
        self.problem = problem


def _require(ok: bool, method: str, problem: str) -> None:
    if not ok:
        raise ContractError(method, problem)


def check_backend_class(cls: type) -> None:
    """The static contract of a backend class (see the module docstring)."""
    name = getattr(cls, "__qualname__", repr(cls))
    _require(isinstance(cls, type) and issubclass(cls, RemoteBackend), name, "not a RemoteBackend subclass")
    _require(not inspect.isabstract(cls), name,
             f"abstract: implement {sorted(getattr(cls, '__abstractmethods__', ()))} (the lifecycle)")
    _require(issubclass(cls, RemoteActor) and issubclass(cls, RemoteSampler), name,
             f"offers neither all of RemoteActor {list(ACTOR_METHODS)} nor RemoteSampler {list(SAMPLER_METHODS)}")
    calls: dict[str, tuple[tuple, dict]] = {  # the arguments verl's worker, replica and driver pass
        "compute_log_prob": ((object(),), {}),
        "compute_ref_log_prob": ((object(),), {}),
        "update_actor": ((object(),), {}),
        "load_checkpoint": ((), {"step": 3}),
        "save_checkpoint": ((), {"step": 3}),
        "update_weights": ((), {}),
        "destroy": ((), {}),
        "reconnect_handle": ((), {}),
        "requires_single_forwarder": ((), {}),
        "generate": (([[1, 2]], {"max_tokens": 4}), {}),
    }
    for method, (args, kwargs) in calls.items():
        try:
            inspect.signature(getattr(cls, method)).bind(None, *args, **kwargs)
        except TypeError as exc:
            raise ContractError(f"{name}.{method}", f"does not take the arguments verl passes "
                                f"({args}, {kwargs}): {exc}") from None
    try:
        inspect.signature(cls.from_config).bind(object(), handle=None)
    except TypeError as exc:
        raise ContractError(f"{name}.from_config", f"expected (main_config, *, handle=None): {exc}") from None
    if callable(getattr(cls, "adopt_sampler", None)):
        _require(SamplerAdopter in cls.__mro__, f"{name}.adopt_sampler",
                 "an optional capability must be declared: list protocols.SamplerAdopter among the bases")
    for method in COMPUTE_METHODS:  # on the class: verl's driver asks before any instance exists
        where = f"{name}.tensor_fields_read({method!r})"
        try:
            fields = fields_read(cls, method)
        except TypeError as exc:
            raise ContractError(where, str(exc)) from None
        _require(fields is None or "input_ids" in fields, where,
                 f"the fields of every call include input_ids; got {sorted(fields or ())}")


def as_read(backend: Any, method: str, data: Any) -> Any:
    """``data`` as the forwarder hands it to ``method`` of ``backend``: its tensor fields narrowed to those the
    backend's class declares the method reads (:class:`~verl.remote_backend.protocols.ReadsTensorFields`), every
    non-tensor entry kept; ``data`` itself where it declares none."""
    fields = fields_read(type(backend), method)
    if fields is None:
        return data
    keep = [k for k in data.keys() if k in fields or not isinstance(data.get(k), torch.Tensor)]  # noqa: SIM118
    return data.select(*keep)


def _narrowed(report: ContractReport, backend: Any, method: str, data: Any) -> Any:
    """``method`` called on :func:`as_read` of ``data``; a failure names the declared fields."""
    narrowed = as_read(backend, method, data)
    try:
        return _timed(report, method, getattr(backend, method), narrowed)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        if narrowed is data:
            raise
        kept = sorted(k for k in narrowed.keys() if isinstance(narrowed.get(k), torch.Tensor))  # noqa: SIM118
        raise ContractError(method, f"failed on the batch narrowed to its declared tensor fields {kept}: "
                            f"{type(exc).__name__}: {exc}") from exc


def fake_batch(*, prompts: int, n: int, mini_batch_rows: int | None = None, temperature: float = 1.0,
               prompt_width: int = 6, response_width: int = 5, vocab: tuple[int, int] = (3, 90),
               seed: int = 0) -> Any:
    """A GRPO batch as verl 0.9.1 hands it to a worker: ``prompts`` x ``n`` rows (the ``n`` samples of a
    prompt adjacent), random lengths and token ids in ``vocab``, nested by verl's own
    ``left_right_2_no_padding``; response-padded ``advantages``/``old_log_probs``; the non-tensor keys
    of verl's trainer (``temperature``, mini-batch sizes, ``epochs`` 1, no shuffle, no entropy)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    rows = prompts * n
    lo, hi = vocab
    prompt_t = torch.zeros((rows, prompt_width), dtype=torch.int64)
    resp_t = torch.zeros((rows, response_width), dtype=torch.int64)
    pmask = torch.zeros((rows, prompt_width), dtype=torch.int64)
    rmask = torch.zeros((rows, response_width), dtype=torch.int64)
    for i in range(prompts):
        plen = int(torch.randint(1, prompt_width + 1, (1,), generator=g))
        prompt = torch.randint(lo, hi, (plen,), generator=g)
        for s in range(n):
            row, rlen = i * n + s, int(torch.randint(1, response_width + 1, (1,), generator=g))
            prompt_t[row, prompt_width - plen:] = prompt
            pmask[row, prompt_width - plen:] = 1
            resp_t[row, :rlen] = torch.randint(lo, hi, (rlen,), generator=g)
            rmask[row, :rlen] = 1
    mask = torch.cat([pmask, rmask], 1)
    data = left_right_2_no_padding(tu.get_tensordict({
        "prompts": prompt_t, "responses": resp_t, "input_ids": torch.cat([prompt_t, resp_t], 1),
        "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0), "response_mask": rmask,
        "old_log_probs": -torch.rand((rows, response_width), generator=g) * rmask,
        "advantages": torch.randn((rows, response_width), generator=g) * rmask,
    }))
    mini = mini_batch_rows or rows
    tu.assign_non_tensor(data, temperature=temperature, global_batch_size=mini, mini_batch_size=mini, epochs=1,
                         seed=1, dataloader_kwargs={"shuffle": False}, calculate_entropy=False)
    return data


@dataclass
class ContractReport:
    """What :func:`run_contract` saw: seconds per method and what the answers held."""

    seconds: dict[str, float] = field(default_factory=dict)
    update_metrics: list[str] = field(default_factory=list)
    samples: int = 0
    saved: Mapping[str, Any] = field(default_factory=dict)


def _json(method: str, value: Any) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ContractError(method, f"not JSON data ({exc}): {value!r:.200}") from None


def _check_log_probs(method: str, out: Any, data: Any) -> torch.Tensor:
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    _require(hasattr(out, "keys") and "log_probs" in out.keys(), method,  # noqa: SIM118 - a TensorDict
             f"no log_probs in the answer (keys {sorted(out.keys()) if hasattr(out, 'keys') else type(out)})")
    lp = out["log_probs"]
    _require(isinstance(lp, torch.Tensor) and lp.is_nested, method, "log_probs: expected a nested tensor like input_ids")
    ids = data["input_ids"]
    _require(torch.equal(lp.offsets().cpu(), ids.offsets().cpu()), method,
             "log_probs: rows of other lengths than input_ids' (value k of a row = log p(token k+1))")
    dense = no_padding_2_padding(lp, data).float() * data["response_mask"]
    _require(bool(torch.isfinite(dense).all()) and float(dense.max()) <= 1e-4, method,
             "log_probs of the response tokens: expected finite values <= 0")
    metrics = tu.get(out, "metrics", {})
    _require(isinstance(metrics, Mapping), method, f"metrics: expected a mapping, got {type(metrics).__name__}")
    return dense


def _timed(report: ContractReport, method: str, call, *args, **kwargs) -> Any:
    t0 = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        report.seconds[method] = time.perf_counter() - t0


def run_contract(backend: RemoteBackend, main_config: Any | None = None, *, prompts: int | None = None,
                 n: int | None = None, mini_batch_rows: int | None = None, temperature: float | None = None,
                 step: int = 1) -> ContractReport:
    """Every method of a live ``backend``, once, on a :func:`fake_batch` (see the module docstring).

    The batch follows ``main_config`` (verl's): ``rollout.n`` samples of ``actor.ppo_mini_batch_size``
    prompts -- one mini-batch -- at ``rollout.temperature``; the keyword arguments override it.
    ``step`` names the checkpoint saved and loaded back. Leaves the backend one update further.
    """
    from verl.utils import tensordict_utils as tu

    check_backend_class(type(backend))
    arr = (main_config or {}).get("actor_rollout_ref", {}) if main_config is not None else {}
    n = n or int(arr.get("rollout", {}).get("n", 1) or 1)
    prompts = prompts or int(arr.get("actor", {}).get("ppo_mini_batch_size", 2) or 2)
    temperature = temperature if temperature is not None else float(arr.get("rollout", {}).get("temperature", 1.0))
    mini = mini_batch_rows or prompts * n
    data = fake_batch(prompts=prompts, n=n, mini_batch_rows=mini, temperature=temperature)
    report = ContractReport()

    handle = _timed(report, "reconnect_handle", backend.reconnect_handle)
    _require(isinstance(handle, dict), "reconnect_handle", f"expected a dict, got {type(handle).__name__}")
    _json("reconnect_handle", handle)
    single = _timed(report, "requires_single_forwarder", backend.requires_single_forwarder)
    _require(isinstance(single, bool), "requires_single_forwarder", f"expected a bool, got {single!r}")

    old = _check_log_probs("compute_log_prob", _narrowed(report, backend, "compute_log_prob", data), data)
    if as_read(backend, "compute_log_prob", data) is not data:  # a field read but not declared shows here
        whole = _check_log_probs("compute_log_prob", backend.compute_log_prob(data), data)
        _require(torch.allclose(whole, old, atol=1e-5), "compute_log_prob",
                 "log_probs differ between the whole batch and the batch narrowed to the declared tensor fields: "
                 "tensor_fields_read leaves out a field the method reads")
    ref = _check_log_probs("compute_ref_log_prob", _narrowed(report, backend, "compute_ref_log_prob", data), data)
    data["old_log_probs"], data["ref_log_prob"] = old, ref
    out = _narrowed(report, backend, "update_actor", data)
    metrics = tu.get(out, "metrics", None) if hasattr(out, "keys") else None
    _require(isinstance(metrics, Mapping) and bool(metrics), "update_actor",
             f"expected a TensorDict whose non-tensor 'metrics' maps names to values, got {metrics!r:.200}")
    mini_batches = (prompts * n) // mini
    for key, values in metrics.items():
        values = values if isinstance(values, list) else [values]
        _require(len(values) == mini_batches, "update_actor",
                 f"metrics[{key!r}]: expected one value per mini-batch ({mini_batches}), got {len(values)}")
    report.update_metrics = sorted(metrics)

    synced = _timed(report, "update_weights", backend.update_weights)
    if inspect.isawaitable(synced):
        raise ContractError("update_weights", "a coroutine: run_contract calls plain methods (the worker awaits one)")
    _require(synced is None or isinstance(synced, Mapping), "update_weights",
             f"expected None or a mapping, got {type(synced).__name__}")

    prompt_ids = [[int(t) for t in row] for row in fake_prompts(data, n)]
    results = _timed(report, "generate", backend.generate, prompt_ids, {"n": n, "max_tokens": 4,
                                                                        "temperature": temperature})
    _require(isinstance(results, Sequence) and len(results) == len(prompt_ids) * n, "generate",
             f"expected {n} sample(s) per prompt ({len(prompt_ids) * n}), got "
             f"{len(results) if isinstance(results, Sequence) else type(results).__name__}")
    for i, result in enumerate(results):
        tokens, logprobs = result_field(result, "token_ids"), result_field(result, "logprobs")
        _require(isinstance(tokens, Sequence) and 0 < len(tokens) <= 4 and all(isinstance(t, int) for t in tokens),
                 "generate", f"results[{i}].token_ids: expected 1..4 ints (max_tokens 4), got {tokens!r:.200}")
        _require(logprobs is None or (len(logprobs) == len(tokens) and all(
            isinstance(v, float) and not math.isnan(v) and v <= 1e-4 for v in logprobs)), "generate",
            f"results[{i}].logprobs: expected None or one float <= 0 per token, got {logprobs!r:.200}")
        _require(result_field(result, "finish_reason") in FINISH_REASONS, "generate",
                 f"results[{i}].finish_reason: expected one of {FINISH_REASONS}")
    report.samples = len(results)

    saved = _timed(report, "save_checkpoint", backend.save_checkpoint, step=step)
    _require(isinstance(saved, Mapping), "save_checkpoint", f"expected a mapping, got {type(saved).__name__}")
    _json("save_checkpoint", dict(saved))
    loaded = _timed(report, "load_checkpoint", backend.load_checkpoint, step=step)
    _require(isinstance(loaded, Mapping), "load_checkpoint", f"expected a mapping, got {type(loaded).__name__}")
    report.saved = dict(saved)
    return report


def fake_prompts(data: Any, n: int) -> list[list[int]]:
    """The distinct prompts of a :func:`fake_batch` (every ``n``-th row's), as token-id lists."""
    responses = data["response_mask"].sum(-1).tolist()
    rows = data["input_ids"].unbind()
    return [rows[i][: len(rows[i]) - int(responses[i])].tolist() for i in range(0, len(rows), n)]
