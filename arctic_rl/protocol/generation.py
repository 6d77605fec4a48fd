"""``/generate``: :class:`SamplingParams`, the request (with its ``sampling_params`` typed), the
answer, and :func:`clean_sampling_params`, the one place a caller's sampling settings are restricted
to the protocol's knobs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, field_serializer, field_validator

from .base import FieldError, Strict, Tolerant

__all__ = [
    "ANSWER_SHAPE_FIELDS",
    "SAMPLING_ALIASES",
    "GenerateRequest",
    "GenerateResponse",
    "GenerateResult",
    "SamplingParams",
    "TokenLogprob",
    "clean_sampling_params",
    "sampled_logprobs",
]

logger = logging.getLogger(__name__)


class SamplingParams(Strict):
    """``sampling_params`` of ``/generate`` (the subset of vLLM's that the protocol uses).
    Non-finite numbers are refused (an infinite temperature is not a distribution)."""

    temperature: float = Field(1.0, ge=0.0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 or 0 = disabled
    max_tokens: int = Field(16, ge=1)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1)
    #: return the log-prob of each sampled token (vLLM: ``logprobs=0`` or ``1``)
    logprobs: int | bool | None = None
    skip_special_tokens: bool = True
    #: the shape of each result's ``logprobs`` (servers listing ``Features.COMPACT_RESULTS`` only; absent =
    #: "candidates"): "candidates" = the vendor's ``{str(token_id): {logprob, rank}}`` per generated token,
    #: "sampled" = the sampled token's log-prob alone, one float per generated token (no top tokens)
    logprobs_format: Literal["candidates", "sampled"] | None = None
    #: false: results carry no ``text`` (an empty string), the token ids only (servers listing
    #: ``Features.COMPACT_RESULTS`` only; absent = true)
    detokenize: bool | None = None

    @property
    def wants_logprobs(self) -> bool:
        """Log-probs asked for (``logprobs`` set and not ``False``; 0 asks for the sampled token's alone)."""
        return self.logprobs is not None and self.logprobs is not False

    @property
    def sampled_logprobs_only(self) -> bool:
        """Log-probs asked for in the compact shape: the sampled token's value per position, nothing else."""
        return self.logprobs_format == "sampled" and self.wants_logprobs

    @property
    def wants_text(self) -> bool:
        return self.detokenize is not False

    @field_validator("top_k", mode="before")
    @classmethod
    def _none_top_k(cls, value: Any) -> Any:
        return -1 if value is None else value


class GenerateRequest(Strict):
    """Body of ``/generate``. ``prompts`` are strings or -- on servers that list
    ``Features.TOKEN_PROMPTS`` -- lists of token ids (no re-tokenisation drift)."""

    prompts: list[str] | list[list[int]] = Field(min_length=1)
    sampling_params: SamplingParams | None = None
    routing_key: Any = None
    strict: bool = False

    @field_serializer("sampling_params")
    def _params_body(self, value: SamplingParams | None) -> dict[str, Any] | None:
        """The knobs that were set (not the model's defaults): the wire carries what the caller chose."""
        return None if value is None else value.model_dump(mode="json", exclude_unset=True)


#: aliases a caller may use for a knob of :class:`SamplingParams`
SAMPLING_ALIASES = {"max_new_tokens": "max_tokens"}
#: :class:`SamplingParams` fields that shape the answer: the client sets them from the server's features,
#: a caller's values are dropped
ANSWER_SHAPE_FIELDS = frozenset({"logprobs_format", "detokenize"})
#: the keys :func:`clean_sampling_params` has logged (each once per process)
_warned: set[str] = set()


def clean_sampling_params(given: Mapping[str, Any]) -> SamplingParams:
    """A caller's sampling settings as :class:`SamplingParams`: aliases renamed, keys the protocol does not
    define (and :data:`ANSWER_SHAPE_FIELDS`) dropped with one warning per key and process, values validated.
    A bad value raises :class:`~.base.FieldError` naming ``sampling_params.<field>``."""
    known = SamplingParams.model_fields
    clean: dict[str, Any] = {}
    for key, value in given.items():
        key = SAMPLING_ALIASES.get(key, key)
        if key in known and key not in ANSWER_SHAPE_FIELDS:
            clean[key] = value
        elif key not in _warned:
            _warned.add(key)
            if key in ANSWER_SHAPE_FIELDS:
                logger.warning("sampling parameter %r shapes the answer and is set from the server's features; "
                               "the given value is not sent", key)
            else:
                logger.warning("sampling parameter %r is not part of the Arctic protocol; not sent", key)
    try:
        return SamplingParams.model_validate(clean)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ())) or "?"
        raise FieldError(f"sampling_params.{loc}", first.get("msg", str(exc)),
                         allowed="see arctic_rl.protocol.SamplingParams", received=first.get("input")) from None


class TokenLogprob(Tolerant):
    """One candidate token of a generated position: its log-prob and its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None


def sampled_logprobs(token_ids: list[int], logprobs: list[Any]) -> list[float]:
    """The sampled tokens' log-probs of a result: ``logprobs[i][str(token_ids[i])]`` (vendor format) or
    the floats as given. ``ValueError`` (``TypeError`` for a malformed entry) naming the position when an
    entry lacks its sampled token."""
    if len(logprobs) != len(token_ids):
        raise ValueError(f"logprobs: {len(logprobs)} entries for {len(token_ids)} generated tokens")
    out: list[float] = []
    for i, (token, entry) in enumerate(zip(token_ids, logprobs)):
        if isinstance(entry, (int, float)) and not isinstance(entry, bool):
            out.append(float(entry))
            continue
        if not isinstance(entry, dict):
            raise TypeError(f"logprobs[{i}]: expected an object {{token_id: {{logprob, rank}}}}, got "
                             f"{type(entry).__name__}")
        value = entry.get(str(int(token)), entry.get(int(token)))
        if value is None:
            raise ValueError(f"logprobs[{i}]: no entry for the sampled token {int(token)} (keys {sorted(entry)[:8]})")
        out.append(float(value.logprob if isinstance(value, TokenLogprob) else value["logprob"]))
    return out


class GenerateResult(Tolerant):
    """One sample. With ``n > 1`` results are grouped by prompt: prompt ``i``'s samples are
    ``results[i*n:(i+1)*n]`` (``prompt_index``/``sample_index`` say so too)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_len: int
    generation_len: int
    prefix_cache_len: int = 0
    #: on the wire (vendor v2 and ours): one ``{str(token_id): TokenLogprob}`` per generated token,
    #: holding the sampled token and the top ``sampling_params.logprobs`` tokens (vLLM's rule). The
    #: adapter hands verl the sampled tokens' values as floats (:func:`sampled_logprobs`).
    logprobs: list[dict[str, TokenLogprob]] | list[float] | None = None
    prompt_index: int | None = None
    sample_index: int | None = None
    weight_version: int | None = None


class GenerateResponse(Tolerant):

    job_id: int
    results: list[GenerateResult]
    #: the sampler's weight version every sample of this answer ran on (servers that batch continuously say so;
    #: absent at the vendor's: read each result's ``weight_version`` then, itself optional)
    weight_version: int | None = None
