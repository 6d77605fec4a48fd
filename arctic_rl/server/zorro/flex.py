"""ZoRRO's grouped response pass: FlexAttention over each prompt's rows, without copies of the prompt.

:mod:`arctic_rl.server.zorro.forward` runs a batch's unique prompts once and then its responses against them. Its
response pass has two forms, chosen process-wide by :func:`set_response_attention`: ``expand`` (in
:mod:`~arctic_rl.server.zorro.forward`: each prompt's keys and values copied to its rows, any kernel) and ``flex``,
which lives here -- the rows, sorted by prompt, form groups of ``n`` rows of one prompt (``n`` divides every
prompt's row count), and each group's ``n*R`` response queries attend to ``[its prompt's P keys | the group's
own n*R keys]`` through FlexAttention (compiled on a GPU) with a block mask that skips the blocks no query may
see (:func:`group_block_mask`, :func:`grouped_attention`).

The compiled kernels are built when first used, the backward inside ``loss.backward()`` where no fallback
can reach it, so :func:`flex_failure` builds both once per head layout, device and dtype before the first
grouped pass and says why they cannot be built, if they cannot; the caller then takes ``expand``.
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "failure_text",
    "flex_failure",
    "group_block_mask",
    "grouped_attention",
    "response_attention",
    "set_response_attention",
]

logger = logging.getLogger(__name__)

#: how the response pass attends to the prompt: "expand" (copy each prompt's keys to its rows, any
#: attention kernel) or "flex" (no copies: FlexAttention over each prompt's group, see set_response_attention)
_RESPONSE_ATTENTION = {"kind": "expand", "compiled": False}
_FLEX: dict[bool, object] = {}


def set_response_attention(kind: str, *, compiled: bool = True) -> None:
    """Choose how ZoRRO's response pass attends to the shared prompt (process-wide).

    ``expand`` (the default): each layer copies its prompt keys and values to the ``B`` rows
    (``index_select``) in front of the responses' own and runs the model's attention with a
    ``[B, 1, R, P+R]`` mask -- any device, any kernel, but two copies of ``B*P`` keys and values per
    layer and a dense masked attention. ``flex``: the rows form groups of ``n`` rows of one prompt (``n``
    the greatest common divisor of the prompts' row counts), and each group's ``n*R`` response queries
    attend to ``[its prompt's P keys | the group's n*R response keys]`` through FlexAttention with a block
    mask (prompt padding, and per row causal over its own response): no copies of the prompt (but one per
    extra group of a prompt) and fully masked blocks skipped (CPU passes that need gradients --
    FlexAttention has no CPU backward -- take ``expand``). ``compiled`` runs FlexAttention through
    ``torch.compile`` (what makes it fast; the reference server uses it on CUDA when the model is
    compiled); uncompiled it is a slow reference used by the CPU tests.
    """
    if kind not in ("expand", "flex"):
        raise ValueError(f"response attention: expected one of ['expand', 'flex'], got {kind!r}")
    _RESPONSE_ATTENTION.update(kind=kind, compiled=bool(compiled))


def response_attention() -> tuple[str, bool]:
    """The response pass chosen by :func:`set_response_attention`: ``(kind, compiled)``."""
    return _RESPONSE_ATTENTION["kind"], _RESPONSE_ATTENTION["compiled"]


def _flex_attention(compiled: bool):
    if compiled not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        # default dynamic: the second shape compiles a shape-generic kernel, so varying batches do not recompile
        _FLEX[compiled] = torch.compile(flex_attention) if compiled else flex_attention
    return _FLEX[compiled]


_FLEX_PROBE: dict[tuple, str | None] = {}


def failure_text(exc: BaseException) -> str:
    """``Type: first line of the message`` (kernel-build errors run to pages)."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def flex_failure(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Build the grouped pass's compiled FlexAttention forward *and backward* once for this head
    layout, device and dtype: ``None`` when that works, else why not. The backward is compiled only
    when first used, inside ``loss.backward()`` where no fallback can reach it; this probe runs first.
    It runs with gradients on whatever the caller's mode: a job's first ZoRRO pass is often a no-grad
    ``/forward``, where the probe's backward would fail and wrongly rule FlexAttention out for the process.
    """
    key = (str(device), dtype, heads, kv_heads, head_dim)
    if key not in _FLEX_PROBE:
        try:
            _flex_probe(device, dtype, heads, kv_heads, head_dim)
            _FLEX_PROBE[key] = None
        except Exception as exc:  # noqa: BLE001 -- any failure means "use the expanding pass"
            _FLEX_PROBE[key] = failure_text(exc)
            logger.warning("ZoRRO: compiled FlexAttention does not work here (%s); using the expanding response pass",
                           _FLEX_PROBE[key])
    return _FLEX_PROBE[key]


def _flex_probe(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """One grouped-pass-shaped FlexAttention forward and backward, compiled (raises when that fails)."""
    p, r, n = _FLEX_BLOCK, _FLEX_BLOCK // 2, 2
    with torch.enable_grad():
        mask = group_block_mask(
            torch.ones(1, p, dtype=torch.bool, device=device),
            torch.ones(1, n * r, dtype=torch.bool, device=device),
            p,
            r,
            compiled=True,
        )
        q = torch.randn(1, heads, n * r, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, p + n * r, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        _flex_attention(True)(q, k, v, block_mask=mask, enable_gqa=heads != kv_heads).sum().backward()


#: FlexAttention's block size: the grouped pass pads its prompt, query and key lengths to multiples of it
#: (its GPU backward kernels could not be built for ragged lengths, e.g. 96 queries x 136 keys)
_FLEX_BLOCK = 128


def _round_up(x: int, block: int = _FLEX_BLOCK) -> int:
    return -(-x // block) * block


def group_block_mask(prompt_valid: torch.Tensor, response_valid: torch.Tensor, p: int, r: int, *, compiled: bool):
    """FlexAttention block mask of the grouped response pass.

    Batch ``u`` is one group of ``n`` rows of one prompt; its queries are the rows' responses back to back
    (``n*R``, padded to a block multiple); its keys are ``[prompt (P, padded to P') | those responses (n*R) |
    padding]``. Query ``q`` (row ``q // R``, position ``q % R``) sees a prompt key that is not
    padding, and a response key of its own row at a position ``<=`` its own that is not padding --
    the plain pass's causal mask, row by row. Padding queries see the prompt (their output is dropped).
    ``compiled`` builds it block by block in a compiled kernel (uncompiled, the whole
    ``groups x Q x KV`` boolean mask would be materialised first: gigabytes for long responses).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    groups, width = response_valid.shape
    p_pad = _round_up(p)

    def mask_mod(b, h, q_idx, kv_idx):
        in_prompt = kv_idx < p_pad
        seen_prompt = (kv_idx < p) & prompt_valid[b, kv_idx.clamp(max=p - 1)]
        k = (kv_idx - p_pad).clamp(min=0, max=width - 1)
        own = (
            (kv_idx < p_pad + width)
            & (k // r == q_idx // r)
            & (k % r <= q_idx % r)
            & response_valid[b, k]
        )
        return torch.where(in_prompt, seen_prompt, own)

    return create_block_mask(
        mask_mod, groups, None, _round_up(width), _round_up(p_pad + width), device=prompt_valid.device,
        _compile=compiled,
    )


def grouped_attention(query, key, value, prompt_key, prompt_value, *, group_size: int, block_mask: object,
                      scaling: float | None):
    """One attention layer of the grouped response pass: ``[B, H, R, D]`` queries of rows sorted by prompt,
    ``group_size`` rows a group, against ``[B/group_size, kv_heads, P, D]`` prompt keys and values (each group's
    prompt's) and the rows' own ``[B, kv_heads, R, D]`` ones, under ``block_mask`` (:func:`group_block_mask`) ->
    ``[B, R, H, D]``, as ``transformers``' attention functions return it (with ``None`` attention weights)."""
    batch, heads, r, dim = query.shape
    n = group_size
    groups = batch // n
    p = prompt_key.shape[2]
    width = n * r
    p_extra = _round_up(p) - p
    kv_extra = _round_up(p + p_extra + width) - (p + p_extra + width)
    q_extra = _round_up(width) - width

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [B, h, R, D] -> [groups, h, n*R, D]
        return t.reshape(groups, n, t.shape[1], r, dim).transpose(1, 2).reshape(groups, t.shape[1], width, dim)

    def keys_of(prompt: torch.Tensor, own: torch.Tensor) -> torch.Tensor:  # [prompt | pad | responses | pad]
        parts = [prompt]
        if p_extra:
            parts.append(prompt.new_zeros(groups, prompt.shape[1], p_extra, dim))
        parts.append(grouped(own))
        if kv_extra:
            parts.append(prompt.new_zeros(groups, prompt.shape[1], kv_extra, dim))
        return torch.cat(parts, dim=2)

    queries = grouped(query)
    if q_extra:
        queries = torch.nn.functional.pad(queries, (0, 0, 0, q_extra))
    flex = _flex_attention(_RESPONSE_ATTENTION["compiled"])
    out = flex(queries, keys_of(prompt_key, key), keys_of(prompt_value, value), block_mask=block_mask,
               scale=scaling, enable_gqa=heads != key.shape[1])
    out = out[:, :, :width]
    return out.reshape(groups, heads, n, r, dim).permute(0, 2, 3, 1, 4).reshape(batch, r, heads, dim), None
