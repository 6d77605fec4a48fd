"""The reference Arctic RL server: a real, self-hostable server for the Arctic RL v2 protocol.

It speaks the same endpoints and bodies as Snowflake's Arctic RL server (v2, DSSST1 tensor
bodies; and the v1 paths with ``torch.save`` bodies, read only with ``weights_only=True``) and
really computes: a DeepSpeed training engine (fwd/bwd, AdamW steps, checkpoints with optimizer
state), a forward-only log-prob engine, and a ``transformers`` sampler, all in one process on CPU
or one GPU. It is what CI and the end-to-end GRPO runs talk to, and what a user without Arctic
runs on one box -- not a cluster engine and not Snowflake's code.

Run it with ``python -m arctic_rl.server`` (see ``docs/SERVER.md``); build the ASGI app with
:func:`create_app`. It never imports ``verl`` or ``ray``. Every module, by role
(a CPU test, ``test_module_map_on_cpu.py``, fails when one is missing here):

=====================================  ==========================================================================
module                                 what it is
=====================================  ==========================================================================
**process**
:mod:`.__main__`                       ``python -m arctic_rl.server``: the command line, then uvicorn
:mod:`.settings`                       process-wide settings (what the command line decides)
:mod:`.launcher`                       start and stop one server process on this machine (tests, the adapter)
:mod:`.app`                            the FastAPI app: the protocol's v2 routes and the v1 ones
:mod:`.errors`                         the HTTP error tree and the handlers that answer every failure in JSON
:mod:`.memory`                         where a job's memory goes, by part, in bytes
:mod:`.memory_probe`                   a diagnostic: where the process's GPU memory is after HTTP calls (``--memory-probe``)
**http/** -- requests
:mod:`.http.bodies`                    reading a body (JSON or DSSST1) under a size and time limit
:mod:`.http.validation`                a ``/forward-backward`` or ``/forward`` body checked into a batch
:mod:`.http.auth`                      the bearer-token middleware
:mod:`.http.idempotency`               the request-id cache that replays a repeated call's answer
:mod:`.http.connection`                the limit on how long a request head may take to arrive
:mod:`.http.control`                   the vendor's v2 control routes (sleep/wake, ``/operation``, ``/log-probs``)
**jobs/** -- what endpoints do
:mod:`.jobs.registry`                  jobs: ids, types, states, the per-job lock
:mod:`.jobs.service`                   :class:`~.jobs.service.ServerState`: what each endpoint does, on which job
:mod:`.jobs.checkpoint`                where a training job's checkpoints live, and their names
:mod:`.jobs.setup_hold`                the samplers asleep while a training or log-prob job is built (start-up peak)
:mod:`.jobs.background_setup`          a job's building and warm-up as one task: ``/initialize`` answers before the warm-up
:mod:`.jobs.sleep_gate`                a training or log-prob pass waits for a sampler sleep in progress
:mod:`.jobs.gc_freeze`                 the garbage collector frozen after each job's warm-up (later collections skip those objects)
:mod:`.jobs.training_stream`           the training and log-prob jobs' calls on a CUDA stream apart from the sampler's
:mod:`.jobs.weight_sync`               a weight sync's loads, then the allocator's unused blocks released
**engines/** -- one per job type
:mod:`.engines.protocols`              what the server asks of a training, log-prob and sampling engine
:mod:`.engines.batch`                  the validated batch an engine computes on (``ParsedBatch``)
:mod:`.engines.training`               the DeepSpeed training engine (fwd/bwd, step, checkpoints)
:mod:`.engines.training_state`         the training engine's checkpoint contents (DeepSpeed's, RNG states)
:mod:`.engines.ds_glue`                DeepSpeed's import, the module it wraps, ZeRO-3 gathering
:mod:`.engines.config`                 ``ds_worker_config`` knobs and the DeepSpeed config
:mod:`.engines.micro_metrics`          one call's metrics from those of its micro-batches
:mod:`.engines.logprob_engine`         the forward-only log-prob engine (the reference policy)
:mod:`.engines.warmup`                 a job's compile warm-up after its creation, state left as it was
:mod:`.engines.part_times`             seconds by named part of long work (the warm-up's log line)
:mod:`.engines.common`                 device, dtype, model loading, process group, no-grad log-probs of a batch
:mod:`.engines.weights`                weight transfer between engines of one process (``/weight-sync``)
:mod:`.engines.sampler_choice`         which sampler a server runs (``--sampler``)
:mod:`.engines.sampling`               the ``transformers`` sampling engine
:mod:`.engines.prompts`                a ``/generate`` call's prompt ids, context and stop ids, checked
:mod:`.engines.generation`             batched sampling with a KV cache; ``Decoding``, what both loops take
:mod:`.engines.fast_generation`        the ``transformers`` sampler's CUDA loop (static cache, compiled step)
:mod:`.engines.hf_steps`               the ``transformers`` sampler's continuous batching
:mod:`.engines.continuous`             continuous batching: one loop thread owns a generation engine
:mod:`.engines.vllm_sampler`           the vLLM sampling engine
:mod:`.engines.vllm_process`           where vLLM's engine core runs (server's process or its own) and what differs
:mod:`.engines.vllm_worker_ext`        methods added to vLLM's worker when its engine core runs apart
:mod:`.engines.ipc_weights`            weight sync into an engine core of its own, through a shared CUDA buffer
:mod:`.engines.vllm_steps`             vLLM's engine driven step by step
:mod:`.engines.vllm_sleep`             vLLM's sleep, tried again when another process disturbs its memory check
:mod:`.engines.vllm_options`           the job's ``vllm_config`` checked, per-prompt seeds
:mod:`.engines.device_memory`          the samplers' sleep/wake memory functions; unused cached blocks released
:mod:`.engines.vllm_answer`            ``/generate`` results built from vLLM's outputs
**compute/** -- per-token numbers
:mod:`.compute.token_logprobs`         per-token log-probs and entropy of a batch, plain or with ZoRRO
:mod:`.compute.chunked_head`           the LM head run chunk by chunk (no whole logits)
:mod:`.compute.losses`                 the policy losses and their metrics
:mod:`.compute.rollout_correction`     importance weights and rejection masks for off-policy rollouts
**zorro/** -- ZoRRO
:mod:`.zorro.forward`                  the two-pass forward (prompts once, then responses), prompt grouping
:mod:`.zorro.attention`                the attention wrapper that routes each layer through the running pass
:mod:`.zorro.flex`                     the grouped response pass with FlexAttention
:mod:`.zorro.passes`                   a call's rows grouped into passes under a token bound
:mod:`.zorro.rule`                     the token rule: when ZoRRO's pass computes few enough tokens to pay
:mod:`.zorro.tuner`                    which pass is faster for one job, timed on its own calls
:mod:`.zorro.planner`                  the one pass choice (groups, rule, tuner) both call paths use
=====================================  ==========================================================================
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
