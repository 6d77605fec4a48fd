"""The reference Arctic RL server: a real, self-hostable server for the Arctic RL v2 protocol.

It speaks the same endpoints and bodies as Snowflake's Arctic RL server (v2, DSSST1 tensor
bodies; and the v1 paths with ``torch.save`` bodies, read only with ``weights_only=True``) and
really computes: a DeepSpeed training engine (fwd/bwd, AdamW steps, checkpoints with optimizer
state), a forward-only log-prob engine, and a ``transformers`` sampler, all in one process on CPU
or one GPU. It is what CI and the end-to-end GRPO runs talk to, and what a user without Arctic
runs on one box -- not a cluster engine and not Snowflake's code.

Run it with ``python -m arctic_rl.server`` (see ``docs/SERVER.md``); build the ASGI app with
:func:`create_app`. Modules: :mod:`.app` (routes), :mod:`.service` (what endpoints do),
:mod:`.engines` (training / log_prob / sampling), :mod:`.validation`, :mod:`.checkpoint`,
:mod:`.idempotency`, :mod:`.auth`, :mod:`.errors`, and the compute kernels :mod:`.logprobs`,
:mod:`.zorro`, :mod:`.losses`. It never imports ``verl`` or ``ray``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ServerSettings", "create_app"]

if TYPE_CHECKING:
    from arctic_rl.server.app import create_app
    from arctic_rl.server.settings import ServerSettings


def __getattr__(name: str) -> Any:  # lazy: importing the package must not pull in FastAPI or torch
    if name == "create_app":
        from arctic_rl.server.app import create_app

        return create_app
    if name == "ServerSettings":
        from arctic_rl.server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
