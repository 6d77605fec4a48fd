"""The sampler side of the Tinker backend: verl's generate calls as ``SamplingClient.sample`` calls.

:class:`SamplerSide` lives in whichever process generates (a rollout server) and samples from
the latest LoRA weights it was told about (:meth:`SamplerSide.adopt`, a ``tinker://`` sampler
path saved by the training side), or from the base model before the first weight sync.
:meth:`SamplerSide.generate` takes token-id prompts and the backend-neutral sampling parameters
of :func:`verl.remote_backend.workers.replica.normalize_sampling_params`; identical prompts of a
batch are folded into one ``sample`` call with ``num_samples`` (so a seeded GRPO group still
gets distinct samples), and every call of a batch is in flight at once.

Tinker's sampler ends a sample only at the ``stop`` it is given (SkyRL's server samples on to
``max_tokens`` past the end-of-sequence token otherwise), while verl's own vLLM rollout stops at
the model's end-of-sequence ids unless told ``ignore_eos``; so those ids are added to ``stop``
(:func:`eos_token_ids`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from verl.remote_backend.errors import RemoteBackendConfigError
from verl.workers.remote_client.tinker.sdk import TinkerSession, wait

__all__ = ["SUPPORTED_PARAMS", "SamplerSide", "eos_token_ids", "tinker_sampling_params"]

logger = logging.getLogger(__name__)

#: sampling keys Tinker's SamplingParams expresses (logprobs: always returned; n: samples per prompt;
#: ignore_eos: whether the end-of-sequence ids join ``stop``)
SUPPORTED_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "n", "ignore_eos")
_warned: set[str] = set()


def eos_token_ids(model_path: str) -> list[int]:
    """The end-of-sequence ids verl's vLLM rollout stops at for ``model_path``: its generation config's
    ``eos_token_id`` (one id or a list) and its tokenizer's. Empty when neither can be read (then a sample
    ends at ``max_tokens`` or a given ``stop``; a warning says so)."""
    from transformers import AutoTokenizer, GenerationConfig

    ids: list[int] = []
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids += [eos] if isinstance(eos, int) else [int(e) for e in eos or ()]
    except (OSError, ValueError):
        pass  # no generation_config.json: the tokenizer's id below
    try:
        tok_eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        if tok_eos is not None:
            ids.append(int(tok_eos))
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer at %s (%s)", model_path, exc)
    if not ids:
        logger.warning("no end-of-sequence id found for %s: Tinker samples run to max_tokens", model_path)
    return list(dict.fromkeys(ids))


def tinker_sampling_params(params: dict[str, Any], eos_ids: Sequence[int] = ()) -> tuple[dict[str, Any], int]:
    """Validated ``SamplingParams`` fields and ``n`` from the backend-neutral sampling dict.

    ``eos_ids`` join ``stop`` unless ``ignore_eos`` is true: no ``stop`` becomes ``eos_ids``, a list of
    token ids gets them added; a string stop list is kept as it is (Tinker takes strings or ids, not both).
    Keys Tinker cannot express are dropped with a one-time warning (``skip_special_tokens`` ...). A bad
    value raises naming ``sampling_params.<key>``.
    """
    for key, value in params.items():
        if key not in SUPPORTED_PARAMS and key not in _warned and value not in (None, False):
            _warned.add(key)
            logger.warning("sampling param %s=%r is not supported by Tinker's sampler; ignored", key, value)
    n = 1 if params.get("n") is None else int(params["n"])
    max_tokens = params.get("max_tokens")
    temperature = float(params.get("temperature", 1.0) if params.get("temperature") is not None else 1.0)
    top_p = float(params.get("top_p", 1.0) if params.get("top_p") is not None else 1.0)
    top_k = int(params.get("top_k", -1) if params.get("top_k") not in (None, 0) else -1)
    checks = (
        ("n", n >= 1, ">= 1", n),
        ("max_tokens", isinstance(max_tokens, int) and max_tokens >= 1, "an integer >= 1", max_tokens),
        ("temperature", temperature >= 0, ">= 0", temperature),
        ("top_p", 0 < top_p <= 1, "0 < top_p <= 1", top_p),
        ("top_k", top_k == -1 or top_k >= 1, "-1 (off) or >= 1", top_k),
    )
    for key, ok, allowed, received in checks:
        if not ok:
            raise RemoteBackendConfigError(f"sampling_params.{key}", "invalid value", allowed=allowed,
                                           received=received)
    stop = params.get("stop")
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise RemoteBackendConfigError("sampling_params.stop", "invalid value", allowed="a string, a list of strings "
                                       "or a list of token ids", received=stop)
    stop = list(stop) if isinstance(stop, tuple) else stop
    if eos_ids and not params.get("ignore_eos"):
        if stop is None or stop == []:
            stop = [int(e) for e in eos_ids]
        elif isinstance(stop, list) and all(isinstance(t, int) for t in stop):
            stop = stop + [int(e) for e in eos_ids if e not in stop]
    seed = params.get("seed")
    fields = {"max_tokens": int(max_tokens), "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "seed": None if seed is None else int(seed), "stop": stop}
    return fields, n


class SamplerSide:
    """Sampling clients of one process (see the module docstring)."""

    def __init__(self, session: TinkerSession, base_model: str, *, eos_from: str = ""):
        self.session = session
        self.base_model = base_model
        self.model_path: str | None = None
        self._client: Any = None
        self._lock = threading.Lock()
        self._eos_from = eos_from or base_model
        self._eos_ids: list[int] | None = None

    def eos_ids(self) -> list[int]:
        """:func:`eos_token_ids` of verl's model path, read on the first generate call."""
        with self._lock:
            if self._eos_ids is None:
                self._eos_ids = eos_token_ids(self._eos_from)
            return self._eos_ids

    def adopt(self, model_path: str) -> None:
        """Sample from ``model_path`` (a ``tinker://`` sampler path) from the next call on."""
        with self._lock:
            if model_path != self.model_path:
                self.model_path = model_path
                self._client = None

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                if self.model_path is None:
                    self._client = self.session.sampling_client(base_model=self.base_model)
                else:
                    self._client = self.session.sampling_client(model_path=self.model_path)
            return self._client

    def close(self) -> None:
        with self._lock:
            self._client = None

    def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> list[dict]:
        """``n`` results per prompt, in prompt order: ``token_ids``, ``logprobs``, ``finish_reason``."""
        if not prompts:
            return []
        fields, n = tinker_sampling_params(params, self.eos_ids())
        sdk_params = self.session.sampling_params(**fields)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(tuple(int(t) for t in prompt), []).append(i)
        client = self.client()
        futures = {key: self.session.sample(client, list(key), n * len(where), sdk_params)
                   for key, where in groups.items()}
        results: list[list[dict]] = [[] for _ in prompts]
        for key, where in groups.items():
            response = wait(futures[key], self.session.timeout_s, "sample")
            sequences = list(response.sequences)
            if len(sequences) != n * len(where):
                from verl.remote_backend.errors import RemoteProtocolError

                raise RemoteProtocolError("sample", f"{len(sequences)} sequences for num_samples={n * len(where)}")
            for j, i in enumerate(where):
                for seq in sequences[j * n : (j + 1) * n]:
                    logprobs = seq.logprobs
                    results[i].append({
                        "token_ids": [int(t) for t in seq.tokens],
                        "logprobs": None if logprobs is None else [float(x) for x in logprobs],
                        "finish_reason": str(getattr(seq.stop_reason, "value", seq.stop_reason)),
                    })
        return [r for per_prompt in results for r in per_prompt]
