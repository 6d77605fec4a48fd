"""What the three engines share: device and dtype choice, model loading, the process group, and
the no-grad ``/forward`` computation.

Models come from ``JobConfig.model_name`` (a local Hugging Face directory, or a hub id when the
machine has the files cached) through ``AutoModelForCausalLM`` with ``trust_remote_code=False``:
a request never makes the server import code. The process group is one ``gloo`` (CPU) or
``nccl`` (CUDA) group of world size 1, created once per process; DeepSpeed's shared-memory
communication op is disabled before DeepSpeed is used so that nothing is JIT-compiled.

What is not here: optimizer steps (training), generation (sampling), HTTP.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from arctic_rl.protocol import ENTROPY_KEY, LOGPROBS_KEY, LogprobAlignment
from arctic_rl.server.engines.batch import ParsedBatch
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.zorro.passes import plan_row_passes
from arctic_rl.server.zorro.planner import ZorroPlan, ZorroPlanner
from arctic_rl.server.zorro.rule import row_slices

__all__ = [
    "compile_model",
    "compute_dtype",
    "ensure_process_group",
    "forward_logprobs",
    "load_model",
    "load_tokenizer",
    "model_vocab_size",
    "process_group_backend",
    "resolve_compile_mode",
    "resolve_device",
]

logger = logging.getLogger("arctic_rl.server")
_PG_LOCK = threading.Lock()
_ATTN_IMPLS = ("eager", "sdpa")


def resolve_device(device: str) -> torch.device:
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a CUDA device that supports it, fp32 otherwise (CPU always fp32)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _model_source(model_name: str) -> str:
    if not isinstance(model_name, str) or not model_name.strip():
        raise BadRequest(
            "model_name: expected a local model directory or hub id", field="model_name", received=model_name
        )
    return str(Path(model_name).expanduser()) if Path(model_name).expanduser().exists() else model_name


def load_model(
    model_name: str, *, device: torch.device, dtype: torch.dtype, attn_implementation: str | None = None
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` on ``device`` (400 if it cannot be loaded)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": False}
    if attn_implementation in _ATTN_IMPLS:
        kwargs["attn_implementation"] = attn_implementation
    elif attn_implementation is not None:
        logger.info("attn_implementation=%r is not used on this server (allowed: %s)", attn_implementation, _ATTN_IMPLS)
    source = _model_source(model_name)
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise BadRequest(
            f"model_name: cannot load {model_name!r}: {exc}", field="model_name", received=model_name
        ) from None
    model.to(device)
    logger.info("loaded %s (%s, %s) in %.1fs", model_name, type(model).__name__, dtype, time.perf_counter() - t0)
    return model


_COMPILE_PROBE: dict[str, str | None] = {}
_RECOMPILE_LIMIT = 64
_COMPILE_PROBE_LOCK = threading.Lock()


def _compile_probe(device: torch.device) -> str | None:
    """Compile and differentiate a tiny function on ``device`` once per process: ``None`` when that works,
    else why not (no C compiler or Triton on the box, an unsupported GPU, ...)."""
    key = str(device)
    with _COMPILE_PROBE_LOCK:
        if key not in _COMPILE_PROBE:
            t0 = time.perf_counter()

            def probe(x: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.silu(x) * x + 1.0

            try:
                x = torch.randn(256, device=device, requires_grad=True)
                torch.compile(probe, dynamic=False)(x).sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                _COMPILE_PROBE[key] = None
            except Exception as exc:  # noqa: BLE001 -- any failure means "run eager"
                _COMPILE_PROBE[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logger.info("torch.compile probe on %s: %s (%.1fs)", key, _COMPILE_PROBE[key] or "works",
                        time.perf_counter() - t0)
        return _COMPILE_PROBE[key]


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """The compile mode a training job runs with: ``auto`` is ``layers`` on CUDA when a probe compile
    works there (else ``off``, with a warning), and ``off`` on CPU; other modes are taken as given."""
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "off"
    failure = _compile_probe(device)
    if failure is not None:
        logger.warning("torch_compile=auto: torch.compile does not work on %s (%s); training runs eager", device,
                       failure)
        return "off"
    # auto means "fastest that works": a graph the compiler cannot build runs eager (Dynamo logs it)
    torch._dynamo.config.suppress_errors = True
    return "layers"


def compile_model(model: torch.nn.Module, mode: str) -> int:
    """``torch.compile`` parts of ``model`` in place (``nn.Module.compile``); returns how many.

    ``layers``: every decoder layer (``model.model.layers``) -- fuses norms, rotary, MLP and
    residuals; one compiled layer serves all layers (ZoRRO's passes included: its attention wrapper
    is a graph break inside each layer, see :mod:`arctic_rl.server.zorro.forward`). ``modules``: only the
    layers' ``*RMSNorm`` and ``*MLP`` children (fuses less). ``off``: nothing. Values agree with
    the eager model up to bf16 rounding; the first calls of each new shape pay the compilation
    (after the second shape Dynamo compiles shape-generic graphs).
    """
    if mode == "off":
        return 0
    if mode not in ("layers", "modules"):
        raise ValueError(f"torch_compile: expected one of ['off', 'layers', 'modules'] here, got {mode!r}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if mode == "layers" and isinstance(layers, torch.nn.ModuleList):
        targets = list(layers)
    else:
        if mode == "layers":
            logger.info("torch_compile=layers: %s has no model.layers; compiling norms and MLPs", type(model).__name__)
        targets = [m for m in (layers or model).modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    # One code object (the layer class's forward) serves every layer; its variants -- grad and no-grad,
    # static then shape-generic, plain and ZoRRO attention, each job of the process -- must not reach
    # Dynamo's default limit of 8, past which it would silently run eager.
    dynamo_config = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, limit_name, max(int(getattr(dynamo_config, limit_name)), _RECOMPILE_LIMIT))
    if mode == "layers" and hasattr(dynamo_config, "nested_graph_breaks"):
        # ZoRRO's attention wrapper is a graph break inside the attention module, which the layer's graph inlines.
        # Without nested graph breaks Dynamo moves the break out to the layer's call of its attention: the layer's
        # entry for ZoRRO's passes then holds no guard on the attention implementation, and a plain pass after
        # ZoRRO's (Dynamo tries the entry used last first) runs through it -- three graphs a layer instead of one.
        # Resuming inside the attention keeps the guard in the layer's graph and halves ZoRRO's graphs.
        dynamo_config.nested_graph_breaks = True
    for module in targets:
        module.compile()
    logger.info("torch_compile=%s: %d modules compiled (first calls of each shape compile)", mode, len(targets))
    return len(targets)


def log_recompiles() -> bool:
    """Have Dynamo write each recompile from now on, with the guard that failed, to the server's log
    (``torch._logging``'s ``recompiles`` artifact, on stderr) -- unless the process chose its torch logs itself
    (``TORCH_LOGS``, left as set). Called once a job's warm-up has ended (its own recompiles are expected): a
    recompile after it costs a call seconds (on a GPU, ZoRRO's first few-shot calls took 11 and 18 s against a
    steady 0.3 and 0.6, ``benchmarks/RESULTS.md`` §2za), and without this line nothing says which shape or guard
    the warm-up did not foresee. Returns whether recompiles are logged now."""
    from torch._logging._internal import log_state

    if not os.environ.get("TORCH_LOGS") and not log_state.is_artifact_enabled("recompiles"):
        torch._logging.set_logs(recompiles=True)
    return log_state.is_artifact_enabled("recompiles")


def load_tokenizer(model_name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(_model_source(model_name), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise BadRequest(
            f"model_name: cannot load the tokenizer of {model_name!r}: {exc}", field="model_name", received=model_name
        ) from None


def model_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the input embedding (what a token id must index)."""
    return int(model.get_input_embeddings().weight.shape[0])


def process_group_backend(device: torch.device) -> str:
    """The backend of the server's world-size-1 process group: gloo for CPU tensors and barriers, with nccl for
    CUDA tensors on CUDA (``cpu:gloo,cuda:nccl``); gloo alone elsewhere.

    The group is created without a ``device_id``, so NCCL communicators are made lazily, at a group's first
    collective on CUDA tensors. With a bound device PyTorch makes every group's communicator at once, and every
    group split from it too: vLLM's engine creates its world, tensor-, pipeline-, data- and context-parallel
    groups in this process (world size 1: they never communicate), and each eager communicator held ~0.45 GiB of
    device memory outside PyTorch's allocator -- 3.2 GiB at vLLM's start on an H200 (benchmarks/RESULTS.md §2q).
    A barrier has no tensor of its own: on an nccl-only group PyTorch runs it as an all-reduce of a one-element
    CUDA tensor, which makes the group's communicator for nothing. With gloo named for CPU, PyTorch runs barriers
    on gloo (a CPU exchange, in-process for one rank), and a collective on CUDA tensors still goes to NCCL.
    DeepSpeed's checkpoint save and load begin and end with ``dist.barrier()``; its save also all-reduces a CUDA
    tensor to check the tag, which :func:`~arctic_rl.server.engines.config.build_training_ds_config` turns off:
    with the barriers alone on gloo the first save still grew the device's use (benchmarks/RESULTS.md §2u).
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def ensure_process_group(device: torch.device) -> None:
    """A world-size-1 process group (:func:`process_group_backend`), created once per process.

    Its rendezvous store is in-process (``HashStore``): no TCP port is opened, so an inherited
    ``MASTER_PORT`` (a parent that runs engines itself, a launcher's leftovers) cannot collide with
    another server on the same machine. The env vars DeepSpeed reads are set to match.
    """
    import torch.distributed as dist

    with _PG_LOCK:
        if dist.is_initialized():
            return
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "0")
        dist.init_process_group(process_group_backend(device), store=dist.HashStore(), rank=0, world_size=1)
        logger.info("process group: %s, world size 1 (in-process store; communicators made at first use)",
                    dist.get_backend())


def forward_logprobs(
    model: torch.nn.Module,
    batch: ParsedBatch,
    *,
    zorro: bool,
    temperature: float,
    max_token_len: int | None = None,
    planner: ZorroPlanner | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float], LogprobAlignment]:
    """No-grad log-probs of a validated batch: ``(batch dict, metrics, alignment)``.

    Both are ``[B, P+R]``, the vendor's layouts (:class:`~arctic_rl.protocol.LogprobAlignment`): ZoRRO
    on, response-aligned (column ``P+j`` = log p(response token ``j``), zeros in the prompt columns);
    off, shifted (column ``c`` = log p(token ``c+1``); with ``meta.response_logprobs_only``, the response
    tokens' columns only, zeros elsewhere, and the LM head runs at those positions only). Rows are
    processed in chunks of at most ``max_token_len`` tokens (at least one row) to bound memory; ZoRRO's
    passes hold as many rows as fit in ``max_token_len`` of the tokens ZoRRO computes
    (:mod:`~arctic_rl.server.zorro.passes`).
    With ZoRRO on, the pass itself is chosen by ``planner`` (:class:`~arctic_rl.server.zorro.planner.ZorroPlanner`:
    the plain pass where deduplicating the prompts would not pay or where the job's timings favour it; an
    untimed one when not given); the layout stays response-aligned either way.
    """
    from arctic_rl.server.compute.token_logprobs import response_logprobs, shifted_logprobs, to_shifted

    device = next(model.parameters()).device
    rows, total = batch.rows, batch.total_len
    step = rows if not max_token_len else max(1, max_token_len // total)
    plan = ZorroPlan(passes=[[part] for part in row_slices(rows, step)])  # the plain passes: max_token_len tokens each
    want_entropy = batch.wants_entropy
    lps, ents = [], []
    tokens_computed, unique = 0, 0
    t0 = time.perf_counter()
    if zorro:
        planner = planner if planner is not None else ZorroPlanner("forward", "/forward")
        # ZoRRO's passes: as many rows as fit in max_token_len ZoRRO tokens (arctic_rl.server.zorro.passes)
        plan = planner.plan(model, batch, plan.passes, lambda groups: [
            [part] for part in plan_row_passes(groups, batch.prompt_len, batch.response_len, max_token_len or None)])
    t_passes = time.perf_counter()
    with torch.no_grad():
        for (start, stop), in plan.passes:
            part = batch.slice_rows(start, stop)
            ids, mask, pos = (t.to(device) for t in (part.input_ids, part.attention_mask, part.position_ids))
            if plan.choice is not None:
                out = response_logprobs(
                    model,
                    ids,
                    mask,
                    pos,
                    part.prompt_len,
                    temperature=temperature,
                    calculate_entropy=want_entropy,
                    zorro=plan.use_zorro,
                )
                left = (part.prompt_len, 0)  # [B, R] -> [B, P+R]: zeros in the prompt columns, as the vendor answers
                lp = torch.nn.functional.pad(out.logprobs, left)
                ent = torch.nn.functional.pad(out.entropy, left) if out.entropy is not None else None
                tokens_computed += out.tokens_computed
                unique += out.unique_prompts
            elif batch.meta.response_logprobs_only:  # the LM head at the response's positions only
                out = response_logprobs(model, ids, mask, pos, part.prompt_len, temperature=temperature,
                                        calculate_entropy=want_entropy)
                lp = to_shifted(out.logprobs, part.prompt_len, total)
                ent = to_shifted(out.entropy, part.prompt_len, total) if out.entropy is not None else None
            else:
                lp, ent = shifted_logprobs(
                    model, ids, mask, pos, temperature=temperature, calculate_entropy=want_entropy
                )
                tokens_computed += part.rows * total
                unique += part.rows
            lps.append(lp.float().cpu())
            if ent is not None:
                ents.append(ent.float().cpu())
    if planner is not None:  # the copies to the host synchronised the device
        planner.record(plan, time.perf_counter() - t_passes)
    result = {LOGPROBS_KEY: torch.cat(lps)}
    if want_entropy:
        result[ENTROPY_KEY] = torch.cat(ents)
    metrics = {
        "tokens_computed": float(tokens_computed),
        "unique_prompts": float(unique),
        "num_rows": float(rows),
        "passes": float(len(plan.passes)),
        "seconds": time.perf_counter() - t0,
    }
    if planner is not None:
        metrics.update(planner.metrics(plan))
    return result, metrics, LogprobAlignment.RESPONSE if zorro else LogprobAlignment.SHIFTED
