"""A job's warm-up: the compiles of its first calls, run when the job is created instead of in verl's step 1.

With ``torch.compile`` in use (``--torch-compile`` resolving to ``layers`` or ``modules``) a job's first calls
compile: the decoder layers (:func:`~arctic_rl.server.engines.common.compile_model`; grad and no-grad, train and
eval, plain and ZoRRO attention are separate graphs), ZoRRO's compiled FlexAttention response pass and its block
mask (:mod:`arctic_rl.server.zorro.flex`, forward and backward), and the fused log-prob / entropy chunks
(:func:`~arctic_rl.server.compute.token_logprobs.set_compiled_token_stats`, forward and backward). On an H200 that
made the first ``/forward`` and ``/forward-backward`` of a SmolLM2-135M job take 10-12 s each, and the first step
15-25x a steady one. :func:`warm_up` runs, on a small synthetic batch, the calls a job will take:

* training job: ``/forward-backward`` through :meth:`TrainingEngine.forward_backward` (DeepSpeed's forward and
  backward, the loss), the plain pass and, when the job has ``zorro_train_enable``, ZoRRO's passes; then
  ``/forward`` through :meth:`TrainingEngine.forward` (eval, no grad; the response-only head the adapter asks
  for), plain and ZoRRO alike;
* log_prob job: ``/forward`` through its ``forward``, plain and ZoRRO alike (its model is not compiled; the
  FlexAttention pass and the fused chunks are, process-wide).

**Shapes.** Nothing here is compiled with ``dynamic=False``: the layers (``nn.Module.compile()``) and FlexAttention
(``torch.compile(flex_attention)``) use Dynamo's default *automatic dynamic* shapes -- the first call of a graph
compiles for its exact sizes, a second call whose sizes differ recompiles once with those dimensions symbolic, and
later sizes reuse that graph; the fused chunks are compiled with ``dynamic=True`` from the start. So each call path
is run on **two** batches whose every varying size differs (rows, prompt groups, rows per prompt, prompt length,
response length, their sums and FlexAttention's 128-padded lengths), and whose sizes within the second batch are
pairwise distinct and above 1 (Dynamo specialises sizes 0 and 1, and gives equal sizes one symbol). The batches'
responses are right-padded as verl's are: without padding, the model's attention takes its unmasked path
(``attention_mask`` ``None``), whose graphs real batches do not use. Each synthetic batch runs twice, its prompts
full-length and then left-padded as verl's are (the client's shape runs left-padded): a pass whose prompts are all
full-length (ZoRRO's prompt pass, say) runs unmasked, one with a padded prompt masked -- separate graphs, each
needing two sizes, and real batches take either (the first real few-shot calls on an H100 recompiled the masked
prompt pass, which the warm-up had met at one size). A ZoRRO job runs the plain pass, then ZoRRO's. ZoRRO's
attention wrapper is a graph break inside each layer; the layers are compiled with nested graph breaks
(:func:`~arctic_rl.server.engines.common.compile_model`), so ZoRRO's layer graphs guard on the attention
implementation and a plain pass after ZoRRO's finds the plain graphs. (Without them ZoRRO's layer entry broke before
the attention and held no such guard: Dynamo tries a frame's entries most recently used first, so a plain pass after
ZoRRO's ran through it and compiled the attention as a frame of its own -- the tuner's first plain calls in verl's
step 2 took 4.8 and 8.7 s on an H100, benchmarks/RESULTS.md §2zb -- and kept running three graphs a layer.) The
fused chunks get detached aliases and are traced without duck sizing
(:func:`~arctic_rl.server.compute.token_logprobs.compile_chunk_fn`), so that passes of one chunk and of several,
with and without grad, share a graph. The first shape's passes run the plain LM head, the
second's the chunked head (:data:`WARM_UP_HEAD_CHUNK_ROWS` positions a chunk): real passes take one or the other by
the size of their logits. ``/forward`` runs with and without entropy. A real batch then finds shape-generic graphs
and does not recompile (before these, on an H200, verl's step 1 still compiled: 14 s each for the first ``/forward``
and ``/forward-backward`` after a 5 s warm-up, benchmarks/RESULTS.md §2o). Shape-generic graphs still carry guards
on their sizes where the compiler chose by a size (inductor's kernels by ``rows x tokens``, say): on an H100 the
first few-shot ``/forward`` and ``/forward-backward`` (128 rows of 1,561 tokens) took 5-40x their steady time after
the warm-up on small batches (§2za). So when the client says what it will send (``ds_worker_config.batch_shape``,
:class:`~arctic_rl.protocol.BatchShape`; our adapter sends verl's sizes) each call path also runs once at those
sizes, on the head path its logits take (:func:`client_shapes`). What can still compile in step 1: the fused chunks
specialise on the temperature (a Python float; the warm-up uses 1, or the job's ZoRRO ``temperature``) and on
whether the loss asks for entropy (``/forward-backward`` warms without, as verl asks by default: ``entropy_coeff``
0); a guard this warm-up does not foresee recompiles as before. Once the warm-up has ended, every recompile is
written to the server's log with the guard that failed (:func:`~arctic_rl.server.engines.common.log_recompiles`).

**State.** The warm-up leaves the job as it found it: no ``/step`` runs, so the weights and optimizer state are
untouched; gradients are discarded (``None`` again); DeepSpeed's counters (steps, samples, the un-stepped backward
count; ZeRO-1/2's gradient window: micro-step id, boundary flag, the accumulated gradient tensors), the
``/forward-backward``-pending flag, the torch RNG states (CPU and CUDA), the job's ZoRRO tuners and choice log (the
warm-up uses its own untimed planners), the job's memory report (buffers, the last call's peak) and the process's
device peak are restored. (The RNG and the peak are the process's: no other job's call runs meanwhile -- the server
runs the warm-up after ``/initialize`` has answered and holds every other compute call until it ends,
:mod:`arctic_rl.server.jobs.background_setup`.) Its seconds are logged -- by round (plain, ZoRRO's) and,
across them, at the client's shape (a few-shot ZoRRO job's took 159 s on an H100, a little longer than verl's start-up,
benchmarks/RESULTS.md §2zd) -- and reported in the job's info (``warm_up_s``). ``--warm-up``
(:data:`~arctic_rl.server.settings.WARM_UP_MODES`): ``auto`` runs it where ``torch.compile`` is in use (a training
job whose model is compiled; a log_prob job once a training job has turned the compiled passes on,
:func:`compiled_paths_on` -- created before one, it has nothing of its own to warm: the training job's ``/forward``
warm-up compiles the same process-wide kernels), ``on`` always, ``off`` never. A warm-up that fails is logged and
the job runs on (its first calls then compile as before).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from arctic_rl.protocol import JobType
from arctic_rl.server import memory as memory_mod
from arctic_rl.server.compute.token_logprobs import head_chunk_budget
from arctic_rl.server.engines.common import log_recompiles
from arctic_rl.server.engines.device_memory import DeviceMemory
from arctic_rl.server.engines.part_times import PartTimes
from arctic_rl.server.http.validation import parse_batch_body
from arctic_rl.server.settings import ServerSettings
from arctic_rl.server.zorro.flex import response_attention
from arctic_rl.server.zorro.planner import ZorroPlanner

__all__ = ["WARM_UP_MAX_TOKENS", "WARM_UP_SHAPES", "client_shapes", "compiled_paths_on", "synthetic_body", "warm_up",
           "warm_up_wanted"]

logger = logging.getLogger("arctic_rl.server")

#: a warm-up batch's (prompts, rows per prompt, prompt length, response length)
Shape = tuple[int, int, int, int]

#: (prompts per micro-batch, rows per prompt, prompt length, response length) of the two warm-up batches: every
#: size differs between them; in the second, the sizes and the 128-padded FlexAttention lengths (prompt 256,
#: responses of a prompt 384, keys 640) are pairwise distinct
WARM_UP_SHAPES = ((2, 2, 6, 5), (5, 3, 130, 90))
#: the most tokens (rows x (prompt + response)) of one call the warm-up runs at the client's batch shape
WARM_UP_MAX_TOKENS = 1 << 23
#: positions per LM-head chunk while the second shape runs: its passes take the chunked head (several chunks, none
#: of 1 row), the path of real passes whose logits exceed one chunk; the first takes the plain head
WARM_UP_HEAD_CHUNK_ROWS = 97
#: DeepSpeed engine counters a forward and backward may move (restored after the warm-up)
_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps", "_unmanaged_backward_count")
#: what ZeRO-1/2's optimizer keeps between backwards and the step that the gradients' reset leaves (with unmanaged
#: accumulation, ``all_grad_tensors`` holds the window's gradients until the step: a warm-up's would be added to
#: the first real mini-batch's; ``averaged_gradients`` are the partition buffers, built again when absent)
_OPTIMIZER_FIELDS = ("micro_step_id", "_is_gradient_accumulation_boundary", "all_grad_tensors", "averaged_gradients",
                     "_offload_accumulated_param_ids", "params_already_reduced")


def _restore(owner: Any, name: str, saved: Any) -> None:
    """Put ``saved`` back as ``owner.name``, in place where it is a container (code may hold a reference)."""
    current = getattr(owner, name, None)
    if isinstance(saved, (dict, set)) and type(current) is type(saved):
        current.clear()
        current.update(saved)
    elif isinstance(saved, list) and isinstance(current, list):
        current[:] = saved
    else:
        setattr(owner, name, saved)


def warm_up_wanted(engine: Any, settings: ServerSettings) -> bool:
    """Whether ``engine``'s job warms up: ``settings.warm_up`` (``auto``: where torch.compile is in use)."""
    if settings.warm_up == "off" or engine.job_type not in (JobType.TRAINING, JobType.LOG_PROB):
        return False
    if settings.warm_up == "on":
        return True
    if engine.job_type == JobType.TRAINING:
        return engine.torch_compile != "off"
    return compiled_paths_on()


def compiled_paths_on() -> bool:
    """Whether this process's log-prob passes run compiled code: ZoRRO's FlexAttention pass or the fused chunks
    (both turned on by a training job whose model is compiled; a log_prob job's own model is never compiled)."""
    from arctic_rl.server.compute.token_logprobs import compiled_token_stats_on

    return response_attention() == ("flex", True) or compiled_token_stats_on()


def synthetic_body(
    vocab_size: int, shape: tuple[int, int, int, int], *, micro_batches: int = 1, train: bool, zorro: bool,
    temperature: float = 1.0, entropy: bool = False, seed: int = 0, left_pad: bool = False,
) -> dict[str, Any]:
    """A decoded ``/forward-backward`` (``train``) or ``/forward`` body of ``shape`` (see :data:`WARM_UP_SHAPES`)
    repeated ``micro_batches`` times: each prompt's rows are consecutive and share its tokens. Like verl's, its
    responses are right-padded: a prompt's first row is full-length, the others end 1 or 2 tokens early (a batch
    without padding takes the model's other attention path, ``attention_mask`` ``None``: its compiled graphs would
    not serve real batches). ``left_pad``: prompts are left-padded as verl's are (the call's ``g``-th prompt
    ``g % 3`` tokens short, so that a pass holds padded and unpadded prompts): a pass whose prompts are all full
    length (ZoRRO's prompt pass, say) runs without an attention mask, one with a padded prompt with it -- two
    graphs, and a real batch's prompts are nearly always padded."""
    groups, n, p, r = shape
    groups *= micro_batches
    g = torch.Generator().manual_seed(seed)
    high = max(4, min(vocab_size, 1000))
    prompts = torch.randint(3, high, (groups, p), generator=g).repeat_interleave(n, dim=0)
    responses = torch.randint(3, high, (groups * n, r), generator=g)
    short = (torch.arange(groups * n) % n).clamp(max=2)  # tokens of padding at the end of each row: 0, 1, 2, 2, ...
    pad = torch.arange(r).unsqueeze(0) >= (r - short).unsqueeze(1)
    responses[pad] = 0
    prompt_mask = torch.ones_like(prompts)
    if left_pad:
        short_prompt = (torch.arange(groups) % 3).clamp(max=p - 1).repeat_interleave(n)
        prompt_pad = torch.arange(p).unsqueeze(0) < short_prompt.unsqueeze(1)
        prompts[prompt_pad] = 0
        prompt_mask[prompt_pad] = 0
    ids = torch.cat([prompts, responses], dim=1)
    mask = torch.cat([prompt_mask, (~pad).long()], dim=1)
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "prompts": prompts, "responses": responses,
                             "response_mask": mask[:, p:].clone()}
    meta: dict[str, Any] = {"zorro_train_enable": zorro, "temperature": temperature, "calculate_entropy": entropy}
    processing: dict[str, Any] = {"post": ["apply_temperature"]} if temperature != 1.0 else {}
    if train:
        batch["advantages"] = torch.randn(groups * n, r, generator=g)
        batch["old_log_probs"] = torch.full((groups * n, r), -2.0)
        processing.update(loss_fn="grpo", config={})
    else:
        meta["response_logprobs_only"] = True
    return {"batch": batch, "meta": meta, "processing": processing}


@contextlib.contextmanager
def _job_state_kept(engine: Any) -> Iterator[None]:
    """Restore what a warm-up's calls may move (module docstring, *State*)."""
    device = engine.device
    cuda = device.type == "cuda" and torch.cuda.is_available()
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
    job_memory = getattr(engine, "memory", None)
    buffers, call = (dict(job_memory.buffers), dict(job_memory.call)) if job_memory is not None else ({}, {})
    memory_mod.device_report(device)  # the process's peak so far (the model's load) kept before the warm-up's calls
    device_peak = memory_mod.device_peak()
    ds = engine.engine if engine.job_type == JobType.TRAINING else None  # the training job's DeepSpeed engine
    counters = {name: getattr(ds, name) for name in _ENGINE_COUNTERS if hasattr(ds, name)}
    optimizer = getattr(ds, "optimizer", None)
    fields = {name: copy.copy(getattr(optimizer, name)) for name in _OPTIMIZER_FIELDS if hasattr(optimizer, name)}
    planners = (getattr(engine, "zorro_planners", None), getattr(engine, "zorro_planner", None))
    pending = getattr(engine, "pending", None)
    try:
        yield
    finally:
        if ds is not None:
            engine.discard_gradients()
            for param in ds.module.parameters():
                param.grad = None
            for name, value in counters.items():
                setattr(ds, name, value)
            for name, value in fields.items():
                _restore(optimizer, name, value)
            ds.train()
        if pending is not None:
            engine.pending = pending
        if planners[0] is not None:
            engine.zorro_planners = planners[0]
        if planners[1] is not None:
            engine.zorro_planner = planners[1]
        if job_memory is not None:
            job_memory.buffers, job_memory.call = buffers, call
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.set_rng_state(cuda_rng, device)
        memory_mod.restore_device_peak(device_peak)
        torch.set_rng_state(rng)


def _planner(call: str, zorro: bool) -> ZorroPlanner:
    """An untimed planner that takes ZoRRO's pass (``min_saving`` 0) or keeps the plain one (no saving reaches 2)."""
    return ZorroPlanner("warm-up", call, min_saving=0.0 if zorro else 2.0, trials=0)


def _head_path(engine: Any, seed: int) -> contextlib.AbstractContextManager:
    """The LM-head path of the warm-up's ``seed``-th shape: the plain head first, the chunked head second, and at
    the client's shape (the third) the path its logits take, as a real call's do."""
    if seed != 1:
        return contextlib.nullcontext()
    return head_chunk_budget(WARM_UP_HEAD_CHUNK_ROWS * max(1, int(engine.vocab_size)) * 4)


def client_shapes(engine: Any) -> tuple[Shape | None, Shape | None]:
    """The warm-up's shapes at the client's ``ds_worker_config.batch_shape`` (:class:`~arctic_rl.protocol.BatchShape`):
    ``(one /forward-backward micro-batch, one /forward)``, each ``(prompts, rows per prompt, P, R)`` with the job's
    ``rollout_n`` rows per prompt where they divide the rows (else 1); ``None`` for a call the job does not take,
    a shape not given, one of more than :data:`WARM_UP_MAX_TOKENS` tokens, or mini-batch rows that do not split
    into the job's ``gradient_accumulation_steps`` (the call itself would be refused)."""
    shape = getattr(engine.knobs, "batch_shape", None)
    if shape is None:
        return None, None
    n = max(1, int(engine.knobs.rollout_n or 1))
    length = shape.prompt_len + shape.response_len

    def rows_shape(rows: int, call_rows: int, call: str) -> Shape | None:
        if call_rows * length > WARM_UP_MAX_TOKENS:
            logger.warning("%s job: no warm-up of %s at the client's batch shape: %d rows x %d tokens exceed %d",
                           engine.job_type.value, call, call_rows, length, WARM_UP_MAX_TOKENS)
            return None
        per = n if rows % n == 0 else 1
        return rows // per, per, shape.prompt_len, shape.response_len

    forward = rows_shape(shape.forward_rows, shape.forward_rows, "/forward")
    if engine.job_type != JobType.TRAINING:
        return None, forward
    gas = int(engine.gas)
    if shape.forward_backward_rows % gas:
        logger.warning("training job: no warm-up of /forward-backward at the client's batch shape: %d rows do not "
                       "split into gradient_accumulation_steps=%d", shape.forward_backward_rows, gas)
        return None, forward
    micro = rows_shape(shape.forward_backward_rows // gas, shape.forward_backward_rows, "/forward-backward")
    return micro, forward


def _batches(client: tuple[Shape | None, Shape | None]) -> list[tuple[int, Shape | None, Shape | None, bool]]:
    """The warm-up's batches, in order: ``(seed, /forward-backward micro-batch, /forward, left_pad)``. Each synthetic
    shape (every size symbolic) with full-length prompts, then left-padded; then the client's shape, left-padded as
    verl's prompts are (module docstring, *Shapes*). The seed also picks the LM-head path (:func:`_head_path`)."""
    synthetic = [(seed, shape, shape, left_pad)
                 for seed, shape in enumerate(WARM_UP_SHAPES) for left_pad in (False, True)]
    return [*synthetic, (len(WARM_UP_SHAPES), *client, True)]


#: the warm-up's rounds, ``(name in the log, whether it takes ZoRRO's pass)``: the plain pass, and for a ZoRRO job
#: then ZoRRO's (module docstring, *Shapes*)
_ROUNDS = (("plain pass", False), ("ZoRRO's pass", True))
#: the log's name of the calls at the client's batch shape (timed across the rounds)
_CLIENT_PART = "at the client's shape"


def _parts_text(times: PartTimes) -> str:
    """``plain pass 80.1s, ZoRRO's pass 110.2s; 60.0s of it at the client's shape``."""
    rounds = ", ".join(f"{name} {times.seconds[name]:.1f}s" for name, _ in _ROUNDS if name in times.seconds)
    client = times.seconds.get(_CLIENT_PART)
    return rounds + (f"; {client:.1f}s of it {_CLIENT_PART}" if client is not None else "")


def _rounds(zorro_job: bool, times: PartTimes) -> Iterator[bool]:
    """Whether each round of the job's warm-up (:data:`_ROUNDS`; a job without ZoRRO runs the first only) takes
    ZoRRO's pass, each round timed as a part of ``times``."""
    for name, zorro in _ROUNDS if zorro_job else _ROUNDS[:1]:
        with times.part(name):
            yield zorro


def _client_part(seed: int, times: PartTimes) -> contextlib.AbstractContextManager:
    """The calls of batch ``seed`` timed as the client's part when it is the client's shape."""
    return times.part(_CLIENT_PART) if seed == len(WARM_UP_SHAPES) else contextlib.nullcontext()


def _warm_training(engine: Any, client: tuple[Shape | None, Shape | None], times: PartTimes) -> int:
    zorro_job = bool(engine.knobs.zorro_train_enable)
    temperature = float(engine.knobs.temperature) if zorro_job and engine.knobs.temperature else 1.0
    calls = 0
    for zorro in _rounds(zorro_job, times):
        engine.zorro_planners = {call: _planner(call, zorro) for call in ("/forward", "/forward-backward")}
        for seed, micro, forward, left_pad in _batches(client):
            with _head_path(engine, seed), _client_part(seed, times):
                if micro is not None:
                    body = synthetic_body(engine.vocab_size, micro, micro_batches=engine.gas, train=True,
                                          zorro=zorro_job, temperature=temperature, seed=seed, left_pad=left_pad)
                    engine.forward_backward(parse_batch_body(body, vocab_size=engine.vocab_size, train=True))
                    engine.discard_gradients()
                    engine.pending = 0
                    calls += 1
                for entropy in (True, False) if forward is not None else ():
                    body = synthetic_body(engine.vocab_size, forward, train=False, zorro=zorro_job,
                                          temperature=temperature, entropy=entropy, seed=seed, left_pad=left_pad)
                    engine.forward(parse_batch_body(body, vocab_size=engine.vocab_size, train=False))
                    calls += 1
    return calls


def _warm_logprob(engine: Any, client: tuple[Shape | None, Shape | None], times: PartTimes) -> int:
    zorro_job = bool(engine.knobs.zorro_train_enable)
    temperature = float(engine.knobs.temperature) if zorro_job and engine.knobs.temperature else 1.0
    calls = 0
    for zorro in _rounds(zorro_job, times):
        engine.zorro_planner = _planner("/forward", zorro)
        for seed, _, shape, left_pad in _batches((None, client[1])):
            for entropy in (True, False) if shape is not None else ():
                body = synthetic_body(engine.vocab_size, shape, train=False, zorro=zorro_job, temperature=temperature,
                                      entropy=entropy, seed=seed, left_pad=left_pad)
                with _head_path(engine, seed), _client_part(seed, times):
                    engine.forward(parse_batch_body(body, vocab_size=engine.vocab_size, train=False))
                calls += 1
    return calls


def warm_up(engine: Any, settings: ServerSettings, device_memory: DeviceMemory | None = None) -> float | None:
    """Warm ``engine``'s job up when :func:`warm_up_wanted` says so (module docstring); its seconds (also set as
    ``engine.warm_up_s``), or ``None`` when it did not run or failed. Either way, once it ran, the blocks its
    passes left in PyTorch's caching allocator go back to the device (``device_memory``, default the engine's
    device's): on a GPU they would otherwise sit beside an awake sampler until verl's first step, the run's
    highest memory (13.1 GiB against a steady 12.3 on the SmolLM2 recipe, benchmarks/RESULTS.md §2o)."""
    if engine.job_type not in (JobType.TRAINING, JobType.LOG_PROB):
        return None  # a sampling job: nothing of it is compiled here
    engine.warm_up_s = None
    if not warm_up_wanted(engine, settings):
        if getattr(engine, "torch_compile", "off") != "off":
            log_recompiles()  # its first calls compile: the log says what
        return None
    job = engine.job_type.value
    memory = device_memory or DeviceMemory.of(getattr(engine, "device", None))
    t0 = time.perf_counter()
    client = client_shapes(engine)
    try:
        with _job_state_kept(engine):
            warm = _warm_training if engine.job_type == JobType.TRAINING else _warm_logprob
            times = PartTimes(memory.synchronize)
            calls = warm(engine, client, times)
    except Exception as exc:  # noqa: BLE001 -- a warm-up must not fail the job: its first calls compile instead
        memory.release_unused()
        logger.warning("%s job: warm-up failed after %.1fs (%s: %s); the first calls compile instead", job,
                       time.perf_counter() - t0, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    finally:
        log_recompiles()  # from now on a recompile is one the warm-up did not foresee
    released = memory.release_unused()["allocator_released_bytes"]
    engine.warm_up_s = round(time.perf_counter() - t0, 3)
    sizes = [f"{call} {shape[0] * shape[1]} rows x {shape[2]} + {shape[3]}"
             for call, shape in zip(("/forward-backward micro-batches of", "/forward"), client) if shape is not None]
    logger.info("%s job: warm-up of %d calls on synthetic batches%s in %.1fs (%s; compiles before step 1); %.2f GB "
                "of cached blocks released", job, calls, f" and at the client's batch shape ({', '.join(sizes)})"
                if sizes else "", engine.warm_up_s, _parts_text(times), released / 1e9)
    return engine.warm_up_s
