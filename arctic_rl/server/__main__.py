"""``python -m arctic_rl.server``: serve the reference Arctic RL server with uvicorn.

Binds 127.0.0.1:7000 by default. A non-loopback ``--host`` needs ``--token`` (every endpoint but
``/health`` then requires ``Authorization: Bearer <token>``), or ``--insecure-no-token`` to
accept an open server (a loud warning is logged). ``ARCTIC_RL_SERVER_TOKEN`` may carry the
token instead of the command line (which other users of the machine can read).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["main", "parse_args"]

TOKEN_ENV = "ARCTIC_RL_SERVER_TOKEN"
#: the default of ``--zorro-min-saving`` when the flag is not given
ZORRO_MIN_SAVING_ENV = "ARCTIC_RL_ZORRO_MIN_SAVING"
#: the default of ``--zorro-trials`` when the flag is not given
ZORRO_TRIALS_ENV = "ARCTIC_RL_ZORRO_TRIALS"
#: the default of ``--gc-freeze`` when the flag is not given
GC_FREEZE_ENV = "ARCTIC_RL_GC_FREEZE"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from arctic_rl.server.memory_probe import PROBE_ENV  # light: torch only once the probe starts
    from arctic_rl.server.settings import (  # light: no torch, no FastAPI
        GC_FREEZE_MODES,
        IN_FLIGHT_ON_WEIGHT_LOAD,
        RELEASE_AT_SYNC_MODES,
        SAMPLERS,
        TORCH_COMPILE_MODES,
        TRAINING_STREAM_MODES,
        VLLM_ENGINE_PROCESS_MODES,
        WARM_UP_MODES,
    )

    p = argparse.ArgumentParser(prog="python -m arctic_rl.server", description="The reference Arctic RL server.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7000, help="bind port (default 7000; 0 = any free port)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (or ${TOKEN_ENV})")
    p.add_argument("--insecure-no-token", action="store_true", help="allow a non-loopback bind without a token")
    p.add_argument("--checkpoint-root", type=Path, default=Path("arctic_rl_checkpoints"), help="checkpoint directory")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="compute device (default cpu)")
    p.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1") or 1), help="torch threads"
    )
    p.add_argument("--max-body-mb", type=float, default=512.0, help="largest request body (default 512 MiB)")
    p.add_argument("--generate-batch-size", type=int, default=64, help="rows per generation forward (default 64)")
    p.add_argument(
        "--torch-compile",
        choices=TORCH_COMPILE_MODES,
        default="auto",
        help="torch.compile the training model: whole decoder layers, only their norms and MLPs, or off. "
        "Default auto: layers on CUDA when a probe compile works there, off on CPU. See docs/PERFORMANCE.md",
    )
    p.add_argument("--warm-up", choices=WARM_UP_MODES, default="auto",
                   help="run each training and log_prob job's passes once on a small batch when it is created, so "
                   "that torch.compile's compiles happen before step 1: auto (default) where torch.compile is in use")
    p.add_argument("--gc-freeze", choices=GC_FREEZE_MODES, default=None,
                   help="once a job's warm-up has ended, freeze the process's objects so that Python's garbage "
                   "collections (vLLM's sleep runs one) skip them: on (default) or off "
                   f"(default ${GC_FREEZE_ENV} or on; arctic_rl/server/jobs/gc_freeze.py)")
    p.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default="auto",
        help="sampling engine: vllm (in-process vLLM; needs --device cuda and the vllm package), transformers, or "
        "auto (default): vllm where it can run, else transformers; the choice is logged",
    )
    p.add_argument(
        "--in-flight-on-weight-load",
        choices=IN_FLIGHT_ON_WEIGHT_LOAD,
        default="wait",
        help="a weight load on the sampler waits for the /generate calls in flight to end on the old weights (wait, "
        "default), or waits for the running engine step only and restarts those calls from their prompts on the new "
        "weights (restart: their work so far is lost); either way no answer mixes two weight versions",
    )
    p.add_argument("--training-stream", choices=TRAINING_STREAM_MODES, default="off",
                   help="run the training and log_prob jobs' calls on a CUDA stream apart from the sampler's, so "
                   "that they and the sampler's generation (asynchronous GRPO) neither queue behind each other's "
                   "kernels nor share the caching allocator's free blocks: on, or off (default; "
                   "arctic_rl/server/jobs/training_stream.py)")
    p.add_argument("--release-at-sync", choices=RELEASE_AT_SYNC_MODES, default="on",
                   help="after a weight sync's loads, hand the caching allocator's unused blocks back to the device, "
                   "as the sampler's sleep and wake do in sync mode; in asynchronous GRPO nothing else releases them "
                   "between steps and the passes' reserve grows: on (default), or off "
                   "(arctic_rl/server/jobs/weight_sync.py)")
    p.add_argument("--vllm-engine-process", choices=VLLM_ENGINE_PROCESS_MODES, default="same",
                   help="where the vLLM sampler's engine core (scheduler, model, KV cache) runs: same (default: the "
                   "server's process; a weight sync copies the training job's live tensors) or own (a process of its "
                   "own, so that generation's scheduling does not hold the interpreter lock the training and log-prob "
                   "passes need while both run, as in asynchronous GRPO; a weight sync goes through a shared CUDA "
                   "buffer; arctic_rl/server/engines/ipc_weights.py)")
    p.add_argument("--zorro-min-saving", type=_share, default=None,
                   metavar="SHARE",
                   help="a ZoRRO request takes the ZoRRO pass only when it saves at least this share of the tokens, "
                   f"else the plain pass (same log-probs, faster there); 0 = always (default ${ZORRO_MIN_SAVING_ENV} "
                   "or 0.55; see docs/SERVER.md)")
    p.add_argument("--zorro-trials", type=_count, default=None, metavar="N",
                   help="for the calls the rule above sends to ZoRRO, each job times N calls of each pass (after "
                   "a warm-up call each) and keeps the faster; 0 = no timing, ZoRRO whenever the rule says "
                   f"(default ${ZORRO_TRIALS_ENV} or 2; see docs/SERVER.md)")
    p.add_argument("--body-timeout-s", type=float, default=300.0,
                   help="longest time to receive one request body; slower clients get a 408 (default 300)")
    p.add_argument("--head-timeout-s", type=float, default=30.0,
                   help="longest time a connection may take to send a request head; then it is closed (default 30)")
    p.add_argument("--limit-concurrency", type=int, default=1024,
                   help="connections + requests in flight above which new requests get a 503; 0 = unbounded")
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="shut down (as on SIGTERM) once process PID is gone: a driver that starts a private server "
                   "passes its own pid so that even a SIGKILLed driver leaves no server behind")
    p.add_argument("--memory-probe", type=Path, default=os.environ.get(PROBE_ENV) or None, metavar="FILE",
                   help="a diagnostic: on CUDA, append where the process's GPU memory is to FILE after HTTP calls "
                   f"(arctic_rl/server/memory_probe.py; slows allocations; or ${PROBE_ENV})")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    args = p.parse_args(argv)
    if args.zorro_min_saving is None:
        try:
            args.zorro_min_saving = _share(os.environ.get(ZORRO_MIN_SAVING_ENV, "0.55"))
        except argparse.ArgumentTypeError as exc:
            p.error(f"${ZORRO_MIN_SAVING_ENV}: {exc}")
    if args.gc_freeze is None:
        args.gc_freeze = os.environ.get(GC_FREEZE_ENV) or "on"
        if args.gc_freeze not in GC_FREEZE_MODES:
            p.error(f"${GC_FREEZE_ENV}: expected one of {list(GC_FREEZE_MODES)}, got {args.gc_freeze!r}")
    if args.zorro_trials is None:
        try:
            args.zorro_trials = _count(os.environ.get(ZORRO_TRIALS_ENV, "2"))
        except argparse.ArgumentTypeError as exc:
            p.error(f"${ZORRO_TRIALS_ENV}: {exc}")
    return args


def _share(text: str) -> float:
    """An argparse type: a float between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def _count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def watch_parent(pid: int, interval_s: float = 1.0) -> threading.Thread:
    """A daemon thread that sends this process SIGTERM (uvicorn's graceful shutdown) once ``pid`` exits."""
    log = logging.getLogger("arctic_rl.server")
    original_ppid = os.getppid()

    def run() -> None:
        while True:
            time.sleep(interval_s)
            gone = not _process_alive(pid) or (pid == original_ppid and os.getppid() != original_ppid)
            if gone:
                log.warning("process %d (--exit-with-parent) is gone; shutting down", pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=run, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("arctic_rl.server")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from arctic_rl.server.settings import ServerSettings, is_loopback_host

    if not is_loopback_host(args.host) and not args.token:
        if not args.insecure_no_token:
            log.error(
                "refusing to bind %s without --token: anyone who reaches the port could train, read and overwrite "
                "the model. Pass --token (or $%s), or --insecure-no-token to accept that.",
                args.host,
                TOKEN_ENV,
            )
            return 2
        log.warning("!" * 72)
        log.warning("INSECURE: serving on %s WITHOUT a token; anyone who can reach it controls the jobs", args.host)
        log.warning("!" * 72)

    from arctic_rl.server.engines.sampler_choice import SamplerUnavailable, resolve_sampler

    try:
        resolve_sampler(args.sampler, args.device)  # fail at start-up, not at the first sampling job
    except SamplerUnavailable as exc:
        log.error("%s", exc)
        return 2

    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        token=args.token or None,
        checkpoint_root=args.checkpoint_root,
        device=args.device,
        threads=args.threads,
        max_body_bytes=max(1, int(args.max_body_mb * 1024 * 1024)),
        generate_batch_size=args.generate_batch_size,
        torch_compile=args.torch_compile,
        warm_up=args.warm_up,
        gc_freeze=args.gc_freeze,
        body_timeout_s=args.body_timeout_s,
        head_timeout_s=args.head_timeout_s,
        limit_concurrency=args.limit_concurrency,
        sampler=args.sampler,
        zorro_min_saving=args.zorro_min_saving,
        zorro_trials=args.zorro_trials,
        in_flight_on_weight_load=args.in_flight_on_weight_load,
        training_stream=args.training_stream,
        release_at_sync=args.release_at_sync,
        vllm_engine_process=args.vllm_engine_process,
        memory_probe=args.memory_probe,  # a Path (argparse converts the env default too) or None
    )
    settings.checkpoint_root.mkdir(parents=True, exist_ok=True)
    from arctic_rl.server.app import create_app

    app = create_app(settings)
    log.info(
        "arctic_rl reference server on http://%s:%d (device=%s, sampler=%s, checkpoint root=%s, auth=%s, instance=%s)",
        args.host,
        args.port,
        args.device,
        resolve_sampler(args.sampler, args.device),
        settings.checkpoint_root,
        "token" if settings.token else "none",
        app.state.server.instance_id,
    )
    if args.exit_with_parent is not None:
        watch_parent(args.exit_with_parent)
    uvicorn_level = args.log_level if args.log_level != "info" else "warning"  # our own logger says enough
    from arctic_rl.server.http.connection import head_timeout_protocol

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        http=head_timeout_protocol(settings.head_timeout_s),
        limit_concurrency=settings.limit_concurrency or None,
        log_level=uvicorn_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
