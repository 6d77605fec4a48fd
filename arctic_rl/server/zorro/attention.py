"""ZoRRO's attention wrapper: how the two passes of :mod:`arctic_rl.server.zorro.forward` reach every attention layer.

The wrapper is registered with ``transformers``' public attention registry (``AttentionInterface``) as
``arctic_rl_zorro_sdpa`` / ``arctic_rl_zorro_eager``, around the ``sdpa`` or ``eager`` function it is named
after. Outside a pass it is exactly that function. Inside one (:func:`running_pass`), the prompt pass hands
each layer's post-rotary keys and values to the :class:`PassState`, and the response pass attends to
``[the prompt's keys | the response's own]`` -- copied to the rows (``expand``) or through the grouped
FlexAttention pass of :mod:`arctic_rl.server.zorro.flex`. The wrapper is opaque to Dynamo
(``torch.compiler.disable``) and reads ``layer_idx`` outside compiled graphs, so one compiled decoder layer
serves every layer on both passes.

:func:`routed_through_wrapper` routes a model's attention through the wrapper for the passes only (plain passes
stay free of its graph breaks); :func:`zorro_unsupported_reason` says why a model cannot take the path.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from arctic_rl.server.zorro import flex as zorro_flex

__all__ = [
    "PassState",
    "ZorroUnsupportedError",
    "attention_base",
    "install_zorro_attention",
    "routed_through_wrapper",
    "running_pass",
    "unwrap_model",
    "zorro_unsupported_reason",
]


class ZorroUnsupportedError(ValueError):
    """The model cannot run the shared-prompt forward (see :func:`zorro_unsupported_reason`)."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``transformers`` model inside a DeepSpeed engine / DDP wrapper (``.module``)."""
    inner = model
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    return inner


#: base attention implementation -> the name its ZoRRO wrapper is registered under
_WRAPPED = {"sdpa": "arctic_rl_zorro_sdpa", "eager": "arctic_rl_zorro_eager"}
_BASE_OF = {wrapped: base for base, wrapped in _WRAPPED.items()}
_REGISTER_LOCK = threading.Lock()
_REGISTERED = False
_EAGER_BY_CLASS: dict[type, object] = {}


@dataclass
class PassState:
    """What the wrapped attention does during one of ZoRRO's passes
    (:func:`~arctic_rl.server.zorro.forward.zorro_forward`; per thread)."""

    #: prompt pass: layer_idx -> (keys, values) ``[U, kv_heads, P, head_dim]``, filled by the layers
    collected: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: response pass: the prompt pass's ``collected``
    prompt_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    #: response pass: row -> unique prompt (``None`` when every row is its own prompt, in order)
    rows: torch.Tensor | None = None
    #: response pass with grouped attention: rows per group and the block mask shared by all layers
    group_size: int = 0
    block_mask: object | None = None
    #: grouped attention: group -> unique prompt (``None`` when group ``u`` is prompt ``u``)
    group_prompt: torch.Tensor | None = None


_STATE = threading.local()


@contextlib.contextmanager
def running_pass(state: PassState) -> Iterator[PassState]:
    """Make ``state`` what the wrapped attention of this thread does until the block ends (one of ZoRRO's
    passes); outside such a block the wrapper is the base implementation. Passes do not nest."""
    if getattr(_STATE, "current", None) is not None:
        raise RuntimeError("zorro_forward: called from inside another zorro_forward on the same thread")
    _STATE.current = state
    try:
        yield state
    finally:
        _STATE.current = None


def attention_base(model: torch.nn.Module) -> str | None:
    """The model's attention implementation, its ZoRRO wrapper counted as the implementation it wraps."""
    impl = _attn_implementation(model)
    return _BASE_OF.get(impl, impl)


def _base_attention(base: str, module: torch.nn.Module):
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    cls = type(module)
    fn = _EAGER_BY_CLASS.get(cls)
    if fn is None:  # each modeling file defines its own eager attention next to the attention class
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if fn is None:
            raise ZorroUnsupportedError(f"ZoRRO cannot run on this model: {cls.__module__} has no eager_attention_forward")
        _EAGER_BY_CLASS[cls] = fn
    return fn


def _make_wrapper(base: str):
    @torch.compiler.disable  # opaque to Dynamo: layer_idx is read here, outside any compiled graph
    def zorro_attention(module, query, key, value, attention_mask, **kwargs):
        fn = _base_attention(base, module)
        state: PassState | None = getattr(_STATE, "current", None)
        if state is None:  # not inside zorro_forward: exactly the base implementation
            return fn(module, query, key, value, attention_mask, **kwargs)
        layer = module.layer_idx
        if state.prompt_kv is None:  # prompt pass: keep this layer's keys and values for the responses
            state.collected[layer] = (key, value)
            return fn(module, query, key, value, attention_mask, **kwargs)
        prompt_key, prompt_value = state.prompt_kv[layer]
        if state.block_mask is not None:
            unsupported = [k for k in ("dropout", "softcap", "sliding_window", "s_aux") if kwargs.get(k)]
            if unsupported:  # features the grouped pass does not implement: zorro_forward falls back
                raise ZorroUnsupportedError(f"the grouped response pass does not implement {unsupported}")
            if state.group_prompt is not None:  # U -> groups; index_select's backward sums a prompt's copies
                prompt_key = prompt_key.index_select(0, state.group_prompt)
                prompt_value = prompt_value.index_select(0, state.group_prompt)
            return zorro_flex.grouped_attention(query, key, value, prompt_key, prompt_value,
                                                group_size=state.group_size, block_mask=state.block_mask,
                                                scaling=kwargs.get("scaling"))
        if state.rows is not None:  # U -> B rows; index_select's backward sums a prompt's copies
            prompt_key = prompt_key.index_select(0, state.rows)
            prompt_value = prompt_value.index_select(0, state.rows)
        key = torch.cat([prompt_key, key], dim=2)
        value = torch.cat([prompt_value, value], dim=2)
        return fn(module, query, key, value, attention_mask, **kwargs)

    zorro_attention.__qualname__ = zorro_attention.__name__ = f"zorro_{base}_attention"
    return zorro_attention


def _register() -> None:
    global _REGISTERED
    with _REGISTER_LOCK:
        if _REGISTERED:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        for base, name in _WRAPPED.items():
            AttentionInterface.register(name, _make_wrapper(base))
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])  # same masks as the base
        _REGISTERED = True


def _attn_implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(unwrap_model(model), "config", None), "_attn_implementation", None)


def install_zorro_attention(model: torch.nn.Module) -> None:
    """Route ``model``'s ``sdpa`` / ``eager`` attention through ZoRRO's wrapper (idempotent).

    Outside ZoRRO's passes the wrapper calls the same function as before, so the model's
    outputs do not change; under ``torch.compile`` the wrapper is a graph break inside each
    attention module. Raises :class:`ZorroUnsupportedError` for another implementation.
    """
    impl = _attn_implementation(model)
    if impl in _BASE_OF:
        return
    if impl not in _WRAPPED:
        raise ZorroUnsupportedError(
            f"ZoRRO cannot run on this model: attn_implementation is {impl!r}; ZoRRO runs with {sorted(_WRAPPED)}"
        )
    _register()
    unwrap_model(model).config._attn_implementation = _WRAPPED[impl]


_ROUTED_LOCK = threading.Lock()
#: model (unwrapped) -> [its attention implementation before, ZoRRO passes in flight on it]
_ROUTED: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def routed_through_wrapper(model: torch.nn.Module) -> Iterator[None]:
    """ZoRRO's wrapper as ``model``'s attention for the duration; the implementation before afterwards.

    Under ``torch.compile`` the wrapper is a graph break in every attention layer, so a plain pass that
    went through it would run as ``2L+1`` graphs instead of one (on one H200, the plain pass is what a
    ZoRRO request takes where ZoRRO's would be slower). Passes in flight on one model are counted: the
    last one out restores the implementation (a model on which :func:`install_zorro_attention` was
    called directly keeps the wrapper).
    """
    inner = unwrap_model(model)
    with _ROUTED_LOCK:
        entry = _ROUTED.get(inner)
        if entry is None:
            entry = _ROUTED[inner] = [_attn_implementation(inner), 0]
            install_zorro_attention(inner)
        entry[1] += 1
    try:
        yield
    finally:
        with _ROUTED_LOCK:
            entry[1] -= 1
            if entry[1] == 0:
                _ROUTED.pop(inner, None)
                if entry[0] in _WRAPPED:  # it was the base implementation
                    inner.config._attn_implementation = entry[0]


#: per model: (its config, the layer-type verdict) -- the config's layer types do not change
_LAYER_VERDICT: weakref.WeakKeyDictionary[torch.nn.Module, tuple[object, str | None]] = weakref.WeakKeyDictionary()


def _layer_reason(inner: torch.nn.Module, config) -> str | None:
    """Why the model's cache layers rule ZoRRO out (sliding window, linear attention), or ``None``."""
    known = _LAYER_VERDICT.get(inner)
    if known is not None and known[0] is config:
        return known[1]
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    reason = f"the model has non-full-attention layers {odd} (sliding window or linear attention)" if odd else None
    _LAYER_VERDICT[inner] = (config, reason)
    return reason


def zorro_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run :func:`~arctic_rl.server.zorro.forward.zorro_forward`, or ``None`` when it can."""
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    if config is None:
        return f"{type(inner).__name__} has no `config`: not a transformers model"
    impl = _attn_implementation(inner)
    if _BASE_OF.get(impl, impl) not in _WRAPPED:
        return f"attn_implementation is {impl!r}; ZoRRO runs with {sorted(_WRAPPED)}"
    if inner.training and any(getattr(m, "gradient_checkpointing", False) for m in inner.modules()):
        return "gradient checkpointing is enabled in training mode (checkpointed layers re-run without the prompt)"
    return _layer_reason(inner, config)
