"""Process-wide settings of the reference server (what the command line decides).

One frozen dataclass, built by ``python -m arctic_rl.server`` from its flags and handed to
:func:`arctic_rl.server.app.create_app`. Nothing here reads a request.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "GC_FREEZE_MODES",
    "IN_FLIGHT_ON_WEIGHT_LOAD",
    "RELEASE_AT_SYNC_MODES",
    "SAMPLERS",
    "TORCH_COMPILE_MODES",
    "TRAINING_STREAM_MODES",
    "VLLM_ENGINE_PROCESS_MODES",
    "ServerSettings",
    "is_loopback_host",
]

Device = Literal["cpu", "cuda"]
#: ``torch.compile`` of the training model: ``auto`` (whole decoder layers on CUDA when a compile probe
#: works there, else off), off, whole decoder layers, or only the layers' norms and MLPs
TORCH_COMPILE_MODES = ("auto", "off", "layers", "modules")
#: the warm-up of training and log_prob jobs at creation (:mod:`arctic_rl.server.engines.warmup`): ``auto`` where
#: torch.compile is in use, ``on`` always, ``off`` never
WARM_UP_MODES = ("auto", "on", "off")
#: Python's garbage collector once a job has warmed up (:mod:`arctic_rl.server.jobs.gc_freeze`): ``on`` freezes the
#: objects alive then (later collections skip them), ``off`` leaves the collector as Python runs it
GC_FREEZE_MODES = ("on", "off")
#: the sampling engine: ``auto`` (vLLM where CUDA and ``vllm`` are there, else ``transformers``), or one of
#: the two (see :mod:`arctic_rl.server.engines.sampler_choice`)
SAMPLERS = ("auto", "vllm", "transformers")
#: what a weight load on the sampler does with the ``/generate`` calls in flight: ``wait`` for them to end on the old
#: weights (the default), or ``restart`` them on the new weights after the running engine step (the load waits for
#: that step only, and the calls' work so far is lost; see :mod:`arctic_rl.server.engines.continuous`)
IN_FLIGHT_ON_WEIGHT_LOAD = ("restart", "wait")
#: the training and log_prob jobs' calls on a CUDA stream apart from the sampler's
#: (:mod:`arctic_rl.server.jobs.training_stream`): ``on``, or ``off`` (every job on the default stream, as before)
TRAINING_STREAM_MODES = ("on", "off")
#: a weight sync hands the caching allocator's unused blocks back after its loads (:mod:`arctic_rl.server.jobs.weight_sync`):
#: ``on`` (the default), or ``off`` (they stay cached)
RELEASE_AT_SYNC_MODES = ("on", "off")
#: where the vLLM sampler's engine core runs (:mod:`arctic_rl.server.engines.vllm_sampler`): ``same`` (the server's
#: process, the default: weight sync copies live tensors) or ``own`` (a process of its own: generation's scheduling no
#: longer shares the server's interpreter lock with the passes; weight sync through a shared CUDA buffer)
VLLM_ENGINE_PROCESS_MODES = ("same", "own")


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    """What the server was started with.

    ``checkpoint_root`` is the only directory the server writes checkpoints to or reads them from;
    request paths are resolved inside it (see :mod:`arctic_rl.server.jobs.checkpoint`).
    """

    host: str = "127.0.0.1"
    port: int = 7000
    token: str | None = None
    checkpoint_root: Path = field(default_factory=lambda: Path(os.getcwd()) / "arctic_rl_checkpoints")
    device: Device = "cpu"
    threads: int = 1
    max_body_bytes: int = 512 * 1024 * 1024
    #: rows per generation forward (requests with more prompts x n are chunked)
    generate_batch_size: int = 64
    #: remembered ``X-Request-Id`` per job
    idempotency_capacity: int = 256
    #: ``torch.compile`` the training model (:data:`TORCH_COMPILE_MODES`; see ``docs/PERFORMANCE.md``)
    torch_compile: str = "auto"
    #: longest time to receive a request body (a client trickling bytes gets a 408)
    body_timeout_s: float = 300.0
    #: longest time a connection may take to send a complete request head (then it is closed)
    head_timeout_s: float = 30.0
    #: connections + running requests above which new requests get a 503 (retryable); 0 = unbounded
    limit_concurrency: int = 1024
    #: the sampling engine (:data:`SAMPLERS`)
    sampler: str = "auto"
    #: share of tokens ZoRRO must save for a ZoRRO request to take the ZoRRO pass (else the plain pass, same
    #: numbers; see :mod:`arctic_rl.server.zorro.rule`); 0 = always when asked
    zorro_min_saving: float = 0.55
    #: timed calls of each pass before a job keeps the faster for the calls the rule sends to ZoRRO (after a
    #: warm-up call each; see :mod:`arctic_rl.server.zorro.tuner`); 0 = no timing, ZoRRO whenever the rule says
    zorro_trials: int = 2
    #: compile before step 1: a job's warm-up passes at creation (:data:`WARM_UP_MODES`)
    warm_up: str = "auto"
    #: freeze the long-lived objects after each job's warm-up (:data:`GC_FREEZE_MODES`)
    gc_freeze: str = "on"
    #: the sampler's weight load and the ``/generate`` calls in flight (:data:`IN_FLIGHT_ON_WEIGHT_LOAD`)
    in_flight_on_weight_load: str = "wait"
    #: the training side's calls on a CUDA stream of their own (:data:`TRAINING_STREAM_MODES`)
    training_stream: str = "off"
    #: a weight sync releases the allocator's unused blocks (:data:`RELEASE_AT_SYNC_MODES`)
    release_at_sync: str = "on"
    #: where the vLLM sampler's engine core runs (:data:`VLLM_ENGINE_PROCESS_MODES`)
    vllm_engine_process: str = "same"
    #: where the GPU memory probe writes (:mod:`arctic_rl.server.memory_probe`; a diagnostic); None = off
    memory_probe: Path | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected one of ['cpu', 'cuda'], got {self.device!r}")
        if self.threads < 1:
            raise ValueError(f"threads: expected >= 1, got {self.threads}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected >= 1, got {self.max_body_bytes}")
        if self.generate_batch_size < 1:
            raise ValueError(f"generate_batch_size: expected >= 1, got {self.generate_batch_size}")
        for name in ("body_timeout_s", "head_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0 seconds, got {getattr(self, name)}")
        if self.limit_concurrency < 0:
            raise ValueError(f"limit_concurrency: expected >= 0 (0 = unbounded), got {self.limit_concurrency}")
        if self.torch_compile not in TORCH_COMPILE_MODES:
            raise ValueError(f"torch_compile: expected one of {list(TORCH_COMPILE_MODES)}, got {self.torch_compile!r}")
        if not 0.0 <= self.zorro_min_saving <= 1.0:
            raise ValueError(
                f"zorro_min_saving: expected a share between 0 and 1 (0 = ZoRRO whenever asked), got {self.zorro_min_saving!r}"
            )
        if isinstance(self.zorro_trials, bool) or not isinstance(self.zorro_trials, int) or self.zorro_trials < 0:
            raise ValueError(
                f"zorro_trials: expected an integer >= 0 (0 = no timing, ZoRRO whenever the rule says), "
                f"got {self.zorro_trials!r}"
            )
        if self.gc_freeze not in GC_FREEZE_MODES:
            raise ValueError(f"gc_freeze: expected one of {list(GC_FREEZE_MODES)}, got {self.gc_freeze!r}")
        if self.warm_up not in WARM_UP_MODES:
            raise ValueError(f"warm_up: expected one of {list(WARM_UP_MODES)}, got {self.warm_up!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler: expected one of {list(SAMPLERS)}, got {self.sampler!r}")
        if self.in_flight_on_weight_load not in IN_FLIGHT_ON_WEIGHT_LOAD:
            raise ValueError(f"in_flight_on_weight_load: expected one of {list(IN_FLIGHT_ON_WEIGHT_LOAD)}, "
                             f"got {self.in_flight_on_weight_load!r}")
        if self.training_stream not in TRAINING_STREAM_MODES:
            raise ValueError(f"training_stream: expected one of {list(TRAINING_STREAM_MODES)}, "
                             f"got {self.training_stream!r}")
        if self.release_at_sync not in RELEASE_AT_SYNC_MODES:
            raise ValueError(f"release_at_sync: expected one of {list(RELEASE_AT_SYNC_MODES)}, "
                             f"got {self.release_at_sync!r}")
        if self.vllm_engine_process not in VLLM_ENGINE_PROCESS_MODES:
            raise ValueError(f"vllm_engine_process: expected one of {list(VLLM_ENGINE_PROCESS_MODES)}, "
                             f"got {self.vllm_engine_process!r}")
        object.__setattr__(self, "checkpoint_root", Path(self.checkpoint_root).expanduser().resolve())
