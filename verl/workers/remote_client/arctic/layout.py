"""verl batches <-> the Arctic server's dense ``[left-padded prompt | right-padded response]`` layout.

verl 0.9.1 hands a worker a ``TensorDict`` whose ``input_ids``/``position_ids`` are *nested*
(jagged, no padding: each row is its real prompt tokens followed by its real response tokens)
and whose response-shaped tensors (``response_mask``, ``old_log_probs``, ``advantages``, ...)
are padded ``[B, R0]`` (legacy trainer) or nested too (V1 trainer). The server wants::

    columns  0 .. P-1            P .. P+R-1
    row b    [pad.. prompt_b ]   [response_b ..pad]      P = longest prompt of the batch,
                                                          R = response_len with ZoRRO

with the rows of a GRPO group adjacent and their prompt columns byte-identical (that is how
ZoRRO finds them). Rows of a group need not be adjacent in verl's order (``_balance_batch``
reorders rows by length), so :func:`plan_layout` computes a permutation ``order`` (server row
``i`` is verl row ``order[i]``) and the way back.

Log-probs come back ``[B, P+R]`` in one of the vendor's two conventions
(:class:`arctic_rl.protocol.LogprobAlignment`): ``shifted`` (``lp[:, c]`` predicts column ``c+1``;
ZoRRO off) or ``response`` (``lp[:, P+j]`` is response token ``j``; ZoRRO on). The answer does not
say which: the caller knows it from the job config.
:func:`nested_from_server` turns either into verl's nested layout: same offsets as
``input_ids``, value ``k`` of a row = log p(token ``k+1`` of the row), which is what verl's
``no_padding_2_padding`` / ``response_from_nested`` slice. Positions the server did not compute
(the prompt under ``response`` alignment, the last token of every row) are 0.

Because prompt and response are adjacent in both layouts, the real token ``k`` of row ``b`` sits
at dense column ``P - prompt_len[b] + k`` -- one index map serves every conversion here.

What is not here: HTTP, the /forward-backward loop, or anything about the model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from arctic_rl.protocol import LogprobAlignment
from verl.remote_backend.errors import RemoteBackendConfigError, RemoteProtocolError

__all__ = [
    "LAYOUT_KEYS",
    "RESPONSE_KEYS",
    "RowLayout",
    "dense_batch",
    "fold_is_weights",
    "group_spans",
    "nested_from_server",
    "plan_layout",
    "shuffled_rows",
    "split_rows",
]

#: response-shaped RL tensors sent left-padded to ``[B, P+R]`` (when present in the batch)
RESPONSE_KEYS = ("response_mask", "old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights")
#: the fields :func:`plan_layout` and :func:`dense_batch` read to lay the tokens out (``prompts``/``responses``/
#: ``attention_mask``: whichever tells prompt from response; ``position_ids``: recomputed where absent)
LAYOUT_KEYS = ("input_ids", "position_ids", "prompts", "responses", "attention_mask")


@dataclass(frozen=True)
class RowLayout:
    """Where every verl row and token goes on the wire (tensors on CPU, verl row order unless noted)."""

    prompt_lens: torch.Tensor  # [B] int64
    response_lens: torch.Tensor  # [B] int64
    offsets: torch.Tensor  # [B+1] int64, the offsets of data["input_ids"]
    prompt_width: int  # P
    response_width: int  # R
    order: torch.Tensor  # [B]: server row i is verl row order[i]
    inverse: torch.Tensor  # [B]: verl row j is server row inverse[j]
    group_of_server_row: torch.Tensor  # [B] group id of each server row (non-decreasing)

    @property
    def rows(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def width(self) -> int:
        return self.prompt_width + self.response_width

    def token_rows_cols(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For every real token (flattened nested order): its verl row, position in the row, dense column."""
        seq_lens = self.offsets.diff()
        rows = torch.repeat_interleave(torch.arange(self.rows), seq_lens)
        k = torch.arange(int(self.offsets[-1])) - self.offsets[:-1][rows]
        cols = self.prompt_width - self.prompt_lens[rows] + k
        return rows, k, cols


def _nested_lengths(t: torch.Tensor) -> torch.Tensor:
    return t.offsets().diff().to(torch.int64)


def _lengths(data, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_lens, response_lens) from whichever of verl's fields carries them."""
    prompts, responses, mask = data.get("prompts", None), data.get("responses", None), data.get("attention_mask", None)
    if prompts is not None and prompts.is_nested:
        prompt_lens = _nested_lengths(prompts)
        response_lens = _nested_lengths(responses) if responses is not None else seq_lens - prompt_lens
    elif prompts is not None and mask is not None and not mask.is_nested:
        p0 = prompts.shape[1]
        prompt_lens = mask[:, :p0].sum(1).to(torch.int64)
        response_lens = mask[:, p0:].sum(1).to(torch.int64)
    elif responses is not None and responses.is_nested:
        response_lens = _nested_lengths(responses)
        prompt_lens = seq_lens - response_lens
    else:
        raise RemoteBackendConfigError(
            "data", "cannot tell prompt from response tokens", allowed="nested `prompts`, or padded `prompts` with "
            "`attention_mask`, or nested `responses`", received=sorted(data.keys()))
    if not torch.equal(prompt_lens + response_lens, seq_lens):
        bad = int(torch.nonzero(prompt_lens + response_lens != seq_lens)[0])
        raise RemoteBackendConfigError(
            "data.input_ids", f"row {bad}: prompt + response lengths disagree with the nested input_ids length",
            allowed=int(seq_lens[bad]), received=int(prompt_lens[bad] + response_lens[bad]))
    if bool((prompt_lens < 1).any()):
        raise RemoteBackendConfigError("data.prompts", "every row needs at least one prompt token", allowed=">= 1",
                                       received=int(prompt_lens.min()))
    return prompt_lens, response_lens


def plan_layout(data, *, response_width: int | None = None, group_rows: bool = True) -> RowLayout:
    """The wire layout of ``data`` (a verl TensorDict with nested ``input_ids``).

    ``response_width``: R (ZoRRO needs exactly ``data.max_response_length``); ``None`` uses the
    longest response. ``group_rows``: put rows with identical prompts next to each other (groups
    in order of first appearance, rows of a group in verl order).
    """
    input_ids = data.get("input_ids", None)
    if input_ids is None or not input_ids.is_nested:
        raise RemoteBackendConfigError("data.input_ids", "expected verl's nested (jagged) input_ids",
                                       allowed="torch.nested jagged tensor", received=type(input_ids).__name__)
    offsets = input_ids.offsets().to(torch.int64).cpu()
    seq_lens = offsets.diff()
    prompt_lens, response_lens = (t.cpu() for t in _lengths(data, seq_lens))
    longest = int(response_lens.max()) if response_lens.numel() else 0
    width = longest if response_width is None else int(response_width)
    if longest > width:
        raise RemoteBackendConfigError(
            "data.max_response_length", f"a response of {longest} tokens does not fit the wire's response width",
            allowed=f"<= {width}", received=longest)
    rows = int(seq_lens.numel())
    if group_rows:
        values = input_ids.values().cpu()
        first: dict[bytes, int] = {}
        group = torch.empty(rows, dtype=torch.int64)
        for b in range(rows):
            start = int(offsets[b])
            key = values[start : start + int(prompt_lens[b])].numpy().tobytes()
            group[b] = first.setdefault(key, len(first))
        order = torch.argsort(group, stable=True)
    else:
        order = torch.arange(rows)
        group = torch.arange(rows)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows)
    return RowLayout(
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        offsets=offsets,
        prompt_width=int(prompt_lens.max()) if rows else 0,
        response_width=width,
        order=order,
        inverse=inverse,
        group_of_server_row=group[order],
    )


def _response_to_wire(t: torch.Tensor, layout: RowLayout, key: str) -> torch.Tensor:
    """A response-shaped verl tensor (nested or padded ``[B, R0]``) -> ``[B, R]`` right-padded with 0."""
    b, r = layout.rows, layout.response_width
    if t.is_nested:
        lens = _nested_lengths(t).cpu()
        if not torch.equal(lens, layout.response_lens):
            raise RemoteBackendConfigError(f"data.{key}", "nested lengths differ from the response lengths",
                                           allowed=layout.response_lens.tolist()[:8], received=lens.tolist()[:8])
        values = t.values().cpu()
        rows = torch.repeat_interleave(torch.arange(b), lens)
        cols = torch.arange(values.shape[0]) - t.offsets().cpu()[:-1][rows]
        out = torch.zeros((b, r), dtype=values.dtype)
        out[rows, cols] = values
        return out
    t = t.cpu()
    if t.dim() != 2 or t.shape[0] != b:
        raise RemoteBackendConfigError(f"data.{key}", "expected a padded [B, response_len] tensor",
                                       allowed=f"[{b}, >= {int(layout.response_lens.max())}]", received=list(t.shape))
    w = min(t.shape[1], r)
    out = torch.zeros((b, r), dtype=t.dtype)
    keep = torch.arange(w).unsqueeze(0) < layout.response_lens.unsqueeze(1)
    out[:, :w] = torch.where(keep, t[:, :w], torch.zeros((), dtype=t.dtype))
    return out


def dense_batch(data, layout: RowLayout, *, pad_token_id: int, keys: tuple[str, ...] = RESPONSE_KEYS) -> dict[str, torch.Tensor]:
    """The ``batch`` of a /forward or /forward-backward body, rows in server order.

    ``input_ids``/``attention_mask``/``position_ids`` ``[B, P+R]``, ``prompts`` ``[B, P]``,
    ``responses`` ``[B, R]``, and each of ``keys`` present in ``data`` left-padded with zeros to
    ``[B, P+R]`` (``loss_mask`` = ``response_mask``).
    """
    b, p, width = layout.rows, layout.prompt_width, layout.width
    rows, _, cols = layout.token_rows_cols()
    ids = data["input_ids"].values().cpu()
    input_ids = torch.full((b, width), int(pad_token_id), dtype=torch.int64)
    input_ids[rows, cols] = ids.to(torch.int64)
    attention_mask = torch.zeros((b, width), dtype=torch.int64)
    attention_mask[rows, cols] = 1
    position_ids = torch.zeros((b, width), dtype=torch.int64)
    pos = data.get("position_ids", None)
    if pos is not None:
        pos_values = pos.values().cpu() if pos.is_nested else None
        if pos_values is None or pos_values.dim() != 1 or pos_values.shape[0] != ids.shape[0]:
            raise RemoteBackendConfigError(
                "data.position_ids", "expected nested 1-D position ids, one per token (mrope/3-D positions are "
                "not supported)", allowed=f"nested, {ids.shape[0]} values", received=getattr(pos, "shape", None))
        position_ids[rows, cols] = pos_values.to(torch.int64)
    else:  # verl always sends them; recompute like verl does (0.. within each row)
        position_ids[rows, cols] = layout.token_rows_cols()[1]
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "prompts": input_ids[:, :p],
        "responses": input_ids[:, p:],
    }
    for key in keys:
        t = data.get(key, None)
        if t is None:
            continue
        resp = _response_to_wire(t, layout, key)
        batch[key] = torch.cat([torch.zeros((b, p), dtype=resp.dtype), resp], dim=1)
    if "response_mask" in batch:
        batch["loss_mask"] = batch["response_mask"]
    return {k: v.index_select(0, layout.order) for k, v in batch.items()}


def fold_is_weights(batch: dict[str, torch.Tensor]) -> None:
    """Multiply ``rollout_is_weights`` into ``advantages`` in place and drop the weights.

    The Arctic loss reads the weights from ``meta`` only, where one tensor reaches every micro-batch
    unsplit, so they cannot be sent per token. Folding is exact for weights ``w >= 0``: verl's clipped
    loss is ``max(-A r, -A clip(r))`` (then ``min(., -A c)`` for ``A < 0``), and scaling ``A`` by ``w``
    scales every branch by ``w`` without changing which branch wins, so ``loss(w A) == w loss(A)``
    token by token. (``pg_clipfrac`` counts a token of weight 0 as unclipped.) Negative or non-finite
    weights are refused."""
    weights = batch.pop("rollout_is_weights", None)
    if weights is None:
        return
    mask = batch["response_mask"] != 0
    real = weights[mask]
    if not bool(torch.isfinite(real).all()) or bool((real < 0).any()):
        bad = real[~torch.isfinite(real) | (real < 0)]
        raise RemoteBackendConfigError(
            "data.rollout_is_weights", "the Arctic loss can apply rollout importance weights only folded into the "
            "advantages, which is exact for non-negative weights only", allowed="finite values >= 0",
            received=f"{bad.numel()} value(s) such as {float(bad[0])}")
    batch["advantages"] = batch["advantages"] * torch.where(mask, weights, torch.ones_like(weights)).to(
        batch["advantages"].dtype)


def nested_from_server(values: torch.Tensor, layout: RowLayout, alignment: str | LogprobAlignment, *,
                       key: str = "logprobs", endpoint: str = "/forward") -> torch.Tensor:
    """Server per-token values ``[B, P+R]`` (rows in server order) -> verl's nested layout (verl row order).

    ``alignment`` comes from what the caller knows (the job's ZoRRO setting), never from the width:
    both of the vendor's layouts are ``[B, P+R]``."""
    b, p, r = layout.rows, layout.prompt_width, layout.response_width
    try:
        alignment = LogprobAlignment(alignment)
    except ValueError:
        raise RemoteProtocolError(endpoint, f"logprob_alignment: expected one of "
                                  f"{[a.value for a in LogprobAlignment]}, got {alignment!r}") from None
    if values.dim() != 2 or tuple(values.shape) != (b, p + r):
        raise RemoteProtocolError(endpoint, f"{key}: {alignment.value} alignment needs [{b}, {p + r}], "
                                  f"got {list(values.shape)}")
    verl_rows = values.detach().cpu().index_select(0, layout.inverse)
    rows, k, cols = layout.token_rows_cols()
    out = torch.zeros(int(layout.offsets[-1]), dtype=verl_rows.dtype)
    if alignment is LogprobAlignment.SHIFTED:
        out = verl_rows[rows, cols]
    else:
        j = k - (layout.prompt_lens[rows] - 1)  # value k of a row predicts response token k - (p_b - 1) ...
        keep = (j >= 0) & (j < layout.response_lens[rows])
        out[keep] = verl_rows[rows[keep], p + j[keep]]  # ... which the server put at column P + j
    out[layout.offsets[1:] - 1] = 0  # the last token predicts nothing
    return torch.nested.nested_tensor_from_jagged(out, offsets=layout.offsets)


# ---------------------------------------------------------------------------------------------
# Splitting server rows into mini- and micro-batches
# ---------------------------------------------------------------------------------------------


def group_spans(layout: RowLayout) -> list[tuple[int, int]]:
    """``[start, end)`` server-row spans of the groups (rows with one prompt)."""
    g = layout.group_of_server_row
    if g.numel() == 0:
        return []
    cuts = (torch.nonzero(g[1:] != g[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, int(g.numel())]
    return list(itertools.pairwise(bounds))


def shuffled_rows(layout: RowLayout, *, seed: int | None) -> torch.Tensor:
    """Server rows with whole groups shuffled (``seed=None``: identity), so groups stay adjacent."""
    if seed is None:
        return torch.arange(layout.rows)
    spans = group_spans(layout)
    perm = torch.randperm(len(spans), generator=torch.Generator().manual_seed(int(seed))).tolist()
    return torch.cat([torch.arange(*spans[i]) for i in perm]) if spans else torch.arange(0)


def split_rows(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``size`` rows (the caller checked divisibility)."""
    return [rows[i : i + size] for i in range(0, int(rows.numel()), size)]
