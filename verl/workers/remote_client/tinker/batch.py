"""verl's batches <-> Tinker's next-token datums (pure Python + torch; no SDK).

verl 0.9.1 hands the worker a ``TensorDict`` whose ``input_ids`` are *nested* (each row: its
real prompt tokens, then its real response tokens) and whose response-shaped tensors
(``response_mask``, ``old_log_probs``, ``advantages``, ``rollout_is_weights``) are nested too (V1
trainer) or padded ``[B, R0]`` (legacy trainer). Tinker trains on ``Datum``s of next-token
prediction: for a row ``t_0 .. t_{L-1}`` with ``P`` prompt tokens::

    model input     t_0 .. t_{L-2}                      (L-1 tokens)
    target_tokens   t_1 .. t_{L-1}                      target j predicts t_{j+1}
    per-target      0 (j < P-1) | response value k at j = P-1+k

Log-probs come back per target (``L-1`` values). verl's nested log-prob layout has ``L`` values
per row, value ``k`` = log p(``t_{k+1}``), so the target values are copied and the last is 0
(:func:`nested_like`).

Loss aggregation: Tinker's built-in losses *sum* over tokens and sequences. verl's
``loss_agg_mode`` is honoured by scaling each row's advantages (:func:`row_scales`):
``token-mean``: 1/T (T = response tokens of the mini-batch; verl 0.9.1 reads ``loss_scale_factor`` only for
``seq-mean-token-sum-norm``, which Tinker's losses cannot express, so it never changes T here);
``seq-mean-token-sum``: 1/B; ``seq-mean-token-mean``: 1/(B * T_row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = [
    "LOSS_AGG_MODES",
    "ROW_KEYS",
    "UPDATE_KEYS",
    "Rows",
    "nested_like",
    "response_values",
    "row_scales",
    "split_rows",
    "target_inputs",
]

#: verl ``loss_agg_mode`` values the adapter expresses with Tinker's summed losses
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass(frozen=True)
class Rows:
    """The real tokens of every verl row and where its response starts."""

    tokens: list[list[int]]
    prompt_lens: list[int]
    response_lens: list[int]
    offsets: torch.Tensor  # [B+1] int64, the offsets of data["input_ids"]

    def __len__(self) -> int:
        return len(self.tokens)


#: the fields :func:`split_rows` reads (``prompts``/``responses``/``attention_mask``: whichever tells prompt from
#: response tokens)
ROW_KEYS = ("input_ids", "prompts", "responses", "attention_mask")
#: the response-shaped fields an update reads (:func:`response_values`; ``rollout_is_weights`` where present)
UPDATE_KEYS = ("response_mask", "old_log_probs", "advantages", "rollout_is_weights")


def _nested_lens(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.offsets().diff().tolist()]


def split_rows(data) -> Rows:
    """Tokens and prompt/response lengths of a verl batch (nested ``input_ids``)."""
    input_ids = data.get("input_ids", None)
    if input_ids is None or not getattr(input_ids, "is_nested", False):
        raise RemoteBackendConfigError("data.input_ids", "expected verl's nested (jagged) input_ids",
                                       allowed="torch.nested jagged tensor", received=type(input_ids).__name__)
    offsets = input_ids.offsets().to(torch.int64).cpu()
    values = input_ids.values().cpu().tolist()
    seq_lens = offsets.diff().tolist()
    prompts, responses, mask = data.get("prompts", None), data.get("responses", None), data.get("attention_mask", None)
    if prompts is not None and prompts.is_nested:
        prompt_lens = _nested_lens(prompts)
    elif responses is not None and responses.is_nested:
        prompt_lens = [s - r for s, r in zip(seq_lens, _nested_lens(responses))]
    elif prompts is not None and mask is not None and not mask.is_nested:
        prompt_lens = [int(x) for x in mask[:, : prompts.shape[1]].sum(1).tolist()]
    else:
        raise RemoteBackendConfigError(
            "data", "cannot tell prompt from response tokens", allowed="nested `prompts` or `responses`, or padded "
            "`prompts` with `attention_mask`", received=sorted(data.keys()))
    response_lens = [s - p for s, p in zip(seq_lens, prompt_lens)]
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        if p < 1 or r < 0:
            raise RemoteBackendConfigError("data.prompts", f"row {b}: needs at least one prompt token and a response",
                                           allowed="prompt >= 1, response >= 0 tokens", received=(p, r))
    tokens = [values[int(offsets[b]) : int(offsets[b + 1])] for b in range(len(seq_lens))]
    return Rows(tokens=tokens, prompt_lens=prompt_lens, response_lens=response_lens, offsets=offsets)


def response_values(data, key: str, rows: Rows) -> list[list[float]]:
    """A response-shaped verl tensor (nested, or padded ``[B, R0]``) as one list per row."""
    t = data.get(key, None)
    if t is None:
        raise RemoteBackendConfigError(f"data.{key}", "missing from the batch", allowed="a response-shaped tensor",
                                       received=sorted(data.keys()))
    if t.is_nested:
        lens = _nested_lens(t)
        if lens != rows.response_lens:
            raise RemoteBackendConfigError(f"data.{key}", "nested lengths differ from the response lengths",
                                           allowed=rows.response_lens[:8], received=lens[:8])
        flat, offs = t.values().cpu().tolist(), t.offsets().cpu().tolist()
        return [[float(x) for x in flat[offs[b] : offs[b + 1]]] for b in range(len(rows))]
    t = t.cpu()
    if t.dim() != 2 or t.shape[0] != len(rows) or t.shape[1] < max(rows.response_lens, default=0):
        raise RemoteBackendConfigError(f"data.{key}", "expected a padded [B, response_len] tensor",
                                       allowed=f"[{len(rows)}, >= {max(rows.response_lens, default=0)}]",
                                       received=list(t.shape))
    return [[float(x) for x in t[b, : rows.response_lens[b]].tolist()] for b in range(len(rows))]


def target_inputs(rows: Rows, b: int, per_response: dict[str, list[float]]) -> tuple[list[int], dict[str, list]]:
    """Model input tokens and ``loss_fn_inputs`` of row ``b`` (see the module docstring)."""
    tokens, p = rows.tokens[b], rows.prompt_lens[b]
    pad = [0.0] * (p - 1)
    inputs: dict[str, list] = {"target_tokens": tokens[1:]}
    for key, values in per_response.items():
        if len(values) != rows.response_lens[b]:
            raise RemoteBackendConfigError(f"data.{key}", f"row {b}: one value per response token",
                                           allowed=rows.response_lens[b], received=len(values))
        inputs[key] = pad + [float(v) for v in values]
    return tokens[:-1], inputs


def nested_like(per_target: list[list[float]], rows: Rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-target values (``L-1`` per row) -> a nested tensor with ``input_ids``' offsets (last value 0)."""
    flat: list[float] = []
    for b, values in enumerate(per_target):
        n = len(rows.tokens[b])
        if len(values) != n - 1:
            raise RemoteBackendConfigError("log_probs", f"row {b}: one value per target token", allowed=n - 1,
                                           received=len(values))
        flat.extend(float(v) for v in values)
        flat.append(0.0)
    return torch.nested.nested_tensor_from_jagged(torch.tensor(flat, dtype=dtype), rows.offsets.clone())


def row_scales(response_masks: list[list[float]], mode: str, loss_scale_factor: float | None = None) -> list[float]:
    """The factor each row's advantages are multiplied by so that Tinker's summed loss is verl's
    ``loss_agg_mode`` aggregate over these rows (one mini-batch). ``loss_scale_factor`` is accepted for
    the call's shape and ignored: verl's ``agg_loss`` uses it only in ``seq-mean-token-sum-norm``."""
    if mode not in LOSS_AGG_MODES:
        raise RemoteBackendConfigError("actor_rollout_ref.actor.loss_agg_mode", "not expressible with Tinker's "
                                       "summed losses", allowed=list(LOSS_AGG_MODES), received=mode)
    rows = len(response_masks)
    if mode == "token-mean":
        total = sum(sum(m) for m in response_masks)
        return [1.0 / max(float(total), 1.0)] * rows
    if mode == "seq-mean-token-sum":
        return [1.0 / max(rows, 1)] * rows
    return [1.0 / (max(rows, 1) * max(sum(m), 1.0)) for m in response_masks]
