"""Every call the Tinker adapter makes into the official ``tinker`` SDK, in one place.

Only the SDK's public client calls are used (``ServiceClient``, ``TrainingClient``,
``SamplingClient`` and the ``tinker.types`` records). The adapter is tested end to end with SDK
0.24.1 (:data:`TESTED_SDK`), the last that speaks JSON, against SkyRL's open server; from SDK 0.25.0
on, training and sampling calls travel as protobuf, which no open server installable here speaks,
so the ``[tinker]`` extra stops below 0.25 and a different installed SDK is named at start-up
(:func:`untested_sdk_line`). Where SDK versions differ, the difference is absorbed here:

* a training-client factory that returns a future-like object (newer SDKs) is resolved;
* ``compute_logprobs`` returns ``len`` values with a leading ``None`` (hosted) or ``len - 1``
  values (some open servers): :func:`full_length_logprobs` normalises to the former;
* sampled sequences carry ``tokens``/``logprobs`` lists in every version.

SDK exceptions become the project's error tree (:func:`wait`). The SDK is imported on first use
only (:func:`import_sdk`), so registering the backend costs no optional dependency.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
from collections.abc import Sequence
from typing import Any

from verl.remote_backend.errors import (
    RemoteBackendConfigError,
    RemoteBackendError,
    RemoteConnectionError,
    RemoteProtocolError,
    RemoteServerError,
    RemoteTimeoutError,
)
from verl.workers.remote_client.tinker.config import API_KEY_ENV

__all__ = ["TESTED_SDK", "TinkerSession", "full_length_logprobs", "import_sdk", "make_datum", "map_error",
           "untested_sdk_line", "wait"]

#: the SDK version this adapter's end-to-end tests run (against SkyRL 0.3.0's Tinker server)
TESTED_SDK = "0.24.1"


def untested_sdk_line(installed: str) -> str | None:
    """The start-up line naming the installed and the tested SDK versions; ``None`` when they are one."""
    if installed == TESTED_SDK:
        return None
    return (f"Tinker SDK {installed} is installed, but this adapter is tested end to end with SDK {TESTED_SDK} "
            "only (JSON wire; SDK >= 0.25 sends training and sampling calls as protobuf, untested here)")


def import_sdk() -> Any:
    """The ``tinker`` module, or a start-up error that says how to install it."""
    try:
        return importlib.import_module("tinker")
    except ImportError as exc:
        raise RemoteBackendConfigError(
            "remote_backend", f"remote_backend=tinker needs the Tinker SDK, which is not importable ({exc})",
            allowed="pip install 'verl-remote-backend[tinker]' (Python >= 3.11)", received="no tinker module",
        ) from None


def _resolve(obj: Any, timeout_s: float, what: str) -> Any:
    """A client, or the result of a future-like client factory (newer SDKs)."""
    if hasattr(obj, "result") and callable(obj.result) and not hasattr(obj, "forward"):
        return wait(obj, timeout_s, what)
    return obj


def wait(future: Any, timeout_s: float, what: str) -> Any:
    """``future.result(timeout)``, with the SDK's and the futures' errors mapped to ours."""
    try:
        return future.result(timeout=timeout_s)
    except RemoteBackendError:
        raise
    except (concurrent.futures.TimeoutError, TimeoutError) as exc:
        raise RemoteTimeoutError(what, timeout_s, type(exc).__name__) from exc
    except Exception as exc:  # the SDK's own exception classes, mapped by their public names
        raise map_error(exc, what) from exc


def map_error(exc: BaseException, what: str) -> RemoteBackendError:
    """One SDK exception -> the project's error tree (by class name: SDK versions move modules)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = getattr(exc, "status_code", None)
    message = str(exc) or type(exc).__name__
    if "APITimeoutError" in names:
        return RemoteTimeoutError(what, 0.0, message)
    if "APIConnectionError" in names:
        return RemoteConnectionError(what, message)
    if isinstance(status, int):
        return RemoteServerError(what, status, message)
    if "RequestFailedError" in names:  # a request the service accepted, then failed; its category says whose fault
        category = str(getattr(getattr(exc, "category", None), "value", getattr(exc, "category", "unknown")))
        detail = {"request_id": getattr(exc, "request_id", None), "category": category}
        return RemoteServerError(what, 400 if category == "user" else 500, message, detail=detail)
    if "ValueError" in names and "400" in message:  # 0.24.1 raises ValueError(... 400 - {...}) for create calls
        return RemoteServerError(what, 400, message)
    return RemoteProtocolError(what, f"{type(exc).__name__}: {message}")


def make_datum(types: Any, input_tokens: Sequence[int], inputs: dict[str, Sequence[float] | Sequence[int]]) -> Any:
    """A ``Datum`` of next-token inputs (``target_tokens`` plus ``weights``/``logprobs``/``advantages``)."""
    model_input = types.ModelInput.from_ints([int(t) for t in input_tokens])
    return types.Datum(model_input=model_input, loss_fn_inputs={k: list(v) for k, v in inputs.items()})


def full_length_logprobs(values: Sequence[float | None], n_tokens: int, what: str) -> list[float | None]:
    """``compute_logprobs`` of ``n_tokens`` tokens as ``n_tokens`` values, the first ``None``."""
    values = list(values)
    if len(values) == n_tokens - 1:
        values = [None, *values]
    if len(values) != n_tokens:
        raise RemoteProtocolError(what, f"{len(values)} log-probs for {n_tokens} tokens (expected {n_tokens} or "
                                        f"{n_tokens - 1})")
    return values


class TinkerSession:
    """One ``ServiceClient`` and the calls the adapter makes through it.

    Args:
        url: the service's base URL (``None``: the SDK's default service).
        call_timeout_s: how long to wait for any one result.
    """

    def __init__(self, url: str | None, *, call_timeout_s: float):
        self.sdk = import_sdk()
        self.types = self.sdk.types
        self.url = url
        self.timeout_s = float(call_timeout_s)
        api_key = os.environ.get(API_KEY_ENV)
        if not api_key:
            raise RemoteBackendConfigError(
                API_KEY_ENV, "the Tinker API key is read from this environment variable, which is not set",
                allowed="your Tinker API key (a local server accepts any key starting with tml-)", received=None,
            )
        kwargs: dict[str, Any] = {"api_key": api_key}
        if url is not None:
            kwargs["base_url"] = url
        try:
            self.service = self.sdk.ServiceClient(**kwargs)
        except Exception as exc:
            raise map_error(exc, "ServiceClient") from exc

    @property
    def version(self) -> str:
        return str(getattr(self.sdk, "__version__", "unknown"))

    # ------------------------------------------------------------------ service
    def supported_models(self) -> list[str]:
        try:
            caps = self.service.get_server_capabilities()
        except Exception as exc:
            raise map_error(exc, "get_server_capabilities") from exc
        return [str(m.model_name) for m in (getattr(caps, "supported_models", None) or [])]

    def create_training_client(self, base_model: str, *, rank: int, seed: int | None, train_mlp: bool,
                               train_attn: bool, train_unembed: bool) -> Any:
        try:
            client = self.service.create_lora_training_client(
                base_model=base_model, rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                train_unembed=train_unembed,
            )
        except Exception as exc:
            raise map_error(exc, "create_lora_training_client") from exc
        return _resolve(client, self.timeout_s, "create_lora_training_client")

    def sampling_client(self, *, model_path: str | None = None, base_model: str | None = None) -> Any:
        try:
            client = self.service.create_sampling_client(model_path=model_path, base_model=base_model)
        except Exception as exc:
            raise map_error(exc, "create_sampling_client") from exc
        return _resolve(client, self.timeout_s, "create_sampling_client")

    # ------------------------------------------------------------------ records
    def datum(self, input_tokens: Sequence[int], inputs: dict[str, Sequence[float] | Sequence[int]]) -> Any:
        return make_datum(self.types, input_tokens, inputs)

    def model_input(self, tokens: Sequence[int]) -> Any:
        return self.types.ModelInput.from_ints([int(t) for t in tokens])

    def sampling_params(self, *, max_tokens: int, temperature: float, top_p: float, top_k: int,
                        seed: int | None, stop: Any) -> Any:
        return self.types.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                         seed=seed, stop=stop)

    # ------------------------------------------------------------------ training client
    def forward(self, tc: Any, datums: list[Any]) -> list[list[float]]:
        """Per-target-token log-probs of each datum under the current training weights."""
        out = wait(tc.forward(datums, "cross_entropy"), self.timeout_s, "forward")
        return [_floats(o, "logprobs", "forward") for o in out.loss_fn_outputs]

    def forward_backward(self, tc: Any, datums: list[Any], loss_fn: str,
                         loss_fn_config: dict[str, float] | None) -> tuple[list[list[float]], dict[str, float]]:
        """Accumulate gradients; returns the per-target-token log-probs and the call's metrics."""
        future = tc.forward_backward(datums, loss_fn, loss_fn_config) if loss_fn_config else \
            tc.forward_backward(datums, loss_fn)
        out = wait(future, self.timeout_s, "forward_backward")
        logprobs = [_floats(o, "logprobs", "forward_backward") for o in out.loss_fn_outputs]
        return logprobs, {str(k): float(v) for k, v in (getattr(out, "metrics", None) or {}).items()}

    def optim_step(self, tc: Any, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        fields = {"learning_rate": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps}
        known = getattr(self.types.AdamParams, "model_fields", {})
        for name, value in (("weight_decay", weight_decay), ("grad_clip_norm", grad_clip_norm)):
            if name in known:
                fields[name] = value
            elif value:
                raise RemoteBackendConfigError(
                    "actor_rollout_ref.actor.optim", f"this Tinker SDK ({self.version}) cannot send {name}",
                    allowed=0.0, received=value)
        out = wait(tc.optim_step(self.types.AdamParams(**fields)), self.timeout_s, "optim_step")
        return {str(k): float(v) for k, v in (getattr(out, "metrics", None) or {}).items()}

    def save_for_sampler(self, tc: Any, name: str) -> str:
        return str(wait(tc.save_weights_for_sampler(name), self.timeout_s, "save_weights_for_sampler").path)

    def save_state(self, tc: Any, name: str) -> str:
        return str(wait(tc.save_state(name), self.timeout_s, "save_state").path)

    def load_state(self, tc: Any, path: str) -> None:
        """Weights and optimizer state (``load_state_with_optimizer``; weights only where absent)."""
        load = getattr(tc, "load_state_with_optimizer", None) or tc.load_state
        wait(load(path), self.timeout_s, "load_state")

    # ------------------------------------------------------------------ sampling client
    def sample(self, sc: Any, prompt: Sequence[int], n: int, params: Any) -> Any:
        """A future of ``n`` samples of ``prompt`` (per-token log-probs are always returned)."""
        return sc.sample(self.model_input(prompt), n, params)

    def compute_logprobs(self, sc: Any, tokens: Sequence[int]) -> Any:
        return sc.compute_logprobs(self.model_input(tokens))


def _floats(output: Any, key: str, what: str) -> list[float]:
    value = output.get(key) if hasattr(output, "get") else None
    if value is None:
        raise RemoteProtocolError(what, f"loss_fn_outputs entry without {key!r}")
    data = value.tolist() if hasattr(value, "tolist") else getattr(value, "data", value)
    return [float(x) for x in data]
