"""A job's warm-up at creation (:mod:`arctic_rl.server.engines.warmup`): the compiles of step 1 before step 1.

On a tiny real model: the warm-up leaves a training job bit-identical (weights, optimizer state, gradients,
DeepSpeed's counters, RNG, pending flag, ZoRRO tuners, memory report) and its first ``/forward-backward`` +
``/step`` give what they give without a warm-up, plain and ZoRRO; a log_prob job likewise. With
``torch_compile=layers`` (Dynamo with a counting backend: no inductor, so no C compiler on the path) the warm-up
compiles every graph the first real calls need -- a batch of other sizes compiles nothing more. The setting
(``--warm-up``) and when ``auto`` turns it on.
"""

from __future__ import annotations

import re

import pytest
import torch

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.__main__ import parse_args
from arctic_rl.server.compute import token_logprobs
from arctic_rl.server.engines import training as training_mod
from arctic_rl.server.engines import warmup
from arctic_rl.server.engines.logprob_engine import LogProbEngine
from arctic_rl.server.engines.part_times import PartTimes
from arctic_rl.server.engines.training import TrainingEngine
from arctic_rl.server.http.validation import parse_batch_body
from arctic_rl.server.settings import WARM_UP_MODES, ServerSettings
from arctic_rl.server.zorro.planner import ZorroPlanner
from arctic_rl.tiny_models import build_tiny_model

#: a real call's sizes: none of them is one the warm-up used (prompts, rows per prompt, P, R)
REAL_SHAPE = (4, 4, 40, 9)  # ZoRRO saves 61% of its tokens: the rule takes it
#: a client's ``ds_worker_config.batch_shape`` (the sizes it will send)
CLIENT_SHAPE = {"prompt_len": 30, "response_len": 7, "forward_rows": 16, "forward_backward_rows": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("warmup") / "model", "qwen3", seed=0)


def _training(model_dir, tmp_path, name: str, *, zorro: bool = False, gas: int = 1, stage: int = 0,
              worker: dict | None = None, **settings) -> TrainingEngine:
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}, "gradient_clipping": 0.0,
          "gradient_accumulation_steps": gas, "zero_optimization": {"stage": stage}}
    config = JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING, ds_config=ds, seed=3,
                       ds_worker_config={"zorro_train_enable": zorro, **(worker or {})})
    return TrainingEngine(config, ServerSettings(checkpoint_root=tmp_path / "ck", **settings), tmp_path / name)


def _real_batch(engine, *, train: bool, zorro: bool, seed: int = 7, entropy: bool = True):
    body = warmup.synthetic_body(engine.vocab_size, REAL_SHAPE, micro_batches=getattr(engine, "gas", 1), train=train,
                                 zorro=zorro, entropy=entropy and not train, seed=seed)
    batch = body["batch"]  # verl's right-padded responses: every other row 3 tokens short
    for key in ("attention_mask", "response_mask"):
        batch[key][1::2, -3:] = 0
    return parse_batch_body(body, vocab_size=engine.vocab_size, train=train)


class _CountingBackend:
    """Dynamo's counting backend (eager graphs, no C compiler; ``frame_count`` compiles), which also counts the
    compiled graphs' runs (``runs``)."""

    def __init__(self) -> None:
        from torch._dynamo.testing import CompileCounter

        self._compiles = CompileCounter()
        self.runs = 0

    @property
    def frame_count(self) -> int:
        return self._compiles.frame_count

    def __call__(self, graph, example_inputs):
        forward = self._compiles(graph, example_inputs)

        def run(*args):
            self.runs += 1
            return forward(*args)

        return run


def counting_compiles(monkeypatch) -> _CountingBackend:
    """Every ``nn.Module.compile`` with :class:`_CountingBackend`: the counter."""
    counter = _CountingBackend()
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend=counter, **kw))
    return counter


def _state(engine: TrainingEngine) -> dict:
    ds = engine.engine
    opt = ds.optimizer
    inner = getattr(opt, "optimizer", opt)
    return {
        "weights": {k: v.detach().clone() for k, v in engine.model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in engine.model.parameters()],
        "optimizer": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in enumerate(inner.state.values())},
        "counters": {n: getattr(ds, n, None) for n in warmup._ENGINE_COUNTERS},
        "micro_step_id": getattr(opt, "micro_step_id", None),
        "rng": torch.get_rng_state(),
        "pending": engine.pending,
        "training": ds.training,
        "planners": dict(engine.zorro_planners),
        "tuners": {c: (p.tuner.trial_calls, {k: t.runs for k, t in p.tuner._times.items()})
                   for c, p in engine.zorro_planners.items()},
        "choices": dict(vars(next(iter(engine.zorro_planners.values())).choices)),
        "memory": (dict(engine.memory.buffers), dict(engine.memory.call)),
        "lr": engine.lr,
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, x in a.items():
        y = b[key]
        if key == "weights":
            assert all(torch.equal(x[k], y[k]) for k in x), key
        elif key == "grads":
            assert all((g is None and h is None) or torch.equal(g, h) for g, h in zip(x, y, strict=True)), key
        elif key == "rng":
            assert torch.equal(x, y), key
        elif key == "planners":
            assert all(x[c] is y[c] for c in x), key
        elif key == "optimizer":
            assert x.keys() == y.keys() and all(
                torch.equal(x[i][k], y[i][k]) if isinstance(x[i][k], torch.Tensor) else x[i][k] == y[i][k]
                for i in x for k in x[i]), key
        else:
            assert x == y, key


def _first_step(engine: TrainingEngine, zorro: bool, *, entropy: bool = True) -> tuple[dict, dict, dict]:
    out = engine.forward_backward(_real_batch(engine, train=True, zorro=zorro))
    step = engine.step()
    logprobs, _, _ = engine.forward(_real_batch(engine, train=False, zorro=zorro, entropy=entropy))
    return out["metrics"], step["metrics"], logprobs


@pytest.mark.parametrize("zorro, gas, stage", [(False, 1, 0), (True, 2, 0), (False, 1, 1), (True, 2, 2)])
def test_the_warm_up_leaves_the_training_job_as_it_was(model_dir, tmp_path, zorro, gas, stage):
    engine = _training(model_dir, tmp_path, "warm", zorro=zorro, gas=gas, stage=stage, warm_up="on")
    baseline = _training(model_dir, tmp_path, "cold", zorro=zorro, gas=gas, stage=stage, warm_up="off")
    assert engine.zero_stage == stage
    try:
        for eng in (engine, baseline):  # a job that has trained a step already (optimizer state, counters)
            _first_step(eng, zorro)
        before = _state(engine)
        assert warmup.warm_up(baseline, baseline_settings := ServerSettings(warm_up="off")) is None
        assert baseline.info()["warm_up_s"] is None and not warmup.warm_up_wanted(baseline, baseline_settings)
        seconds = warmup.warm_up(engine, ServerSettings(warm_up="on"))
        assert seconds is not None and seconds > 0 and engine.info()["warm_up_s"] == seconds
        _assert_same(before, _state(engine))
        warm, cold = _first_step(engine, zorro), _first_step(baseline, zorro)
        for a, b in zip(warm[:2], cold[:2], strict=True):
            assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}
        assert all(torch.equal(warm[2][k], cold[2][k]) for k in cold[2])
        assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), baseline.model.parameters(),
                                                        strict=True))
    finally:
        engine.close()
        baseline.close()


def test_the_warm_up_of_a_log_prob_job_changes_nothing(model_dir, tmp_path, caplog, monkeypatch):
    from torch._logging._internal import log_state

    config = JobConfig(model_name=str(model_dir), job_type=JobType.LOG_PROB, ds_worker_config={"zorro_train_enable": True})
    engine = LogProbEngine(config, ServerSettings(warm_up="on", zorro_trials=0))  # every ZoRRO call takes ZoRRO
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    torch._logging.set_logs()
    try:
        planner, weights = engine.zorro_planner, {k: v.clone() for k, v in engine.model.state_dict().items()}
        expected, _, _ = engine.forward(_real_batch(engine, train=False, zorro=True))
        rng, trial_calls = torch.get_rng_state(), planner.tuner.trial_calls
        assert not log_state.is_artifact_enabled("recompiles")
        with caplog.at_level("INFO", logger="arctic_rl.server"):
            seconds = warmup.warm_up(engine, ServerSettings(warm_up="on"))
        assert seconds is not None and engine.info()["warm_up_s"] == seconds
        # plain and ZoRRO; 2 shapes, each with full-length and left-padded prompts; with and without entropy
        assert "log_prob job: warm-up of 16 calls" in caplog.text
        # where the seconds went, by round (no client shape here)
        assert re.search(r"log_prob job: warm-up of 16 calls on synthetic batches in [0-9.]+s \(plain pass [0-9.]+s, "
                         r"ZoRRO's pass [0-9.]+s; compiles before step 1\)", caplog.text)
        assert log_state.is_artifact_enabled("recompiles")  # from now on a recompile is logged with its guard
        assert engine.zorro_planner is planner and planner.tuner.trial_calls == trial_calls
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in weights.items())
        got, _, _ = engine.forward(_real_batch(engine, train=False, zorro=True))
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    finally:
        engine.close()
        torch._logging.set_logs()


@pytest.mark.parametrize("stage", [0, 2])
def test_discarded_gradients_never_reach_the_next_step(model_dir, tmp_path, stage):
    """What the warm-up, a failed pass and a checkpoint load rely on: ZeRO-1/2 hold a window's gradients in the
    optimizer until the step (not in ``.grad``), and :meth:`TrainingEngine.discard_gradients` drops them too."""
    engine = _training(model_dir, tmp_path, "discard", stage=stage)
    baseline = _training(model_dir, tmp_path, "fresh", stage=stage)
    try:
        engine._forward_backward(_real_batch(engine, train=True, zorro=False, seed=11))
        engine.discard_gradients()
        engine.pending = 0
        got, expected = _first_step(engine, False), _first_step(baseline, False)
        assert got[1]["grad_norm"] == expected[1]["grad_norm"]
        assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), baseline.model.parameters(),
                                                        strict=True))
    finally:
        engine.close()
        baseline.close()


def test_a_failed_warm_up_is_logged_and_the_job_runs_on(model_dir, tmp_path, monkeypatch, caplog):
    engine = _training(model_dir, tmp_path, "fail", warm_up="on")
    try:
        before = _state(engine)

        def boom(*args, **kwargs):
            raise RuntimeError("no kernel for this")

        monkeypatch.setattr(engine, "forward", boom)
        with caplog.at_level("WARNING", logger="arctic_rl.server"):
            assert warmup.warm_up(engine, ServerSettings(warm_up="on")) is None
        assert "warm-up failed" in caplog.text and "RuntimeError: no kernel for this" in caplog.text
        _assert_same(before, _state(engine))  # the forward-backward that ran before the failure is undone
    finally:
        engine.close()


class _Allocator:
    """A device whose caching allocator holds ``cached`` unused bytes until they are released."""

    def __init__(self, cached: int) -> None:
        self.cached, self.released = cached, []

    def memory(self):
        from arctic_rl.server.engines.device_memory import DeviceMemory

        def empty_cache():
            self.released.append(self.cached)
            self.cached = 0

        return DeviceMemory(reserved=lambda: self.cached, empty_cache=empty_cache)


def test_the_warm_up_hands_its_cached_blocks_back(model_dir, tmp_path, monkeypatch, caplog):
    engine = LogProbEngine(JobConfig(model_name=str(model_dir), job_type=JobType.LOG_PROB), ServerSettings())
    try:
        device = _Allocator(3 << 30)
        with caplog.at_level("INFO", logger="arctic_rl.server"):
            assert warmup.warm_up(engine, ServerSettings(warm_up="on"), device.memory()) is not None
        assert device.released == [3 << 30] and "3.22 GB of cached blocks released" in caplog.text
        device = _Allocator(1 << 30)  # a failed warm-up leaves nothing cached behind either
        monkeypatch.setattr(engine, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no kernel")))
        assert warmup.warm_up(engine, ServerSettings(warm_up="on"), device.memory()) is None
        assert device.released == [1 << 30]
        device = _Allocator(1 << 30)  # no warm-up, no release
        assert warmup.warm_up(engine, ServerSettings(warm_up="off"), device.memory()) is None
        assert device.released == []
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("zorro", [False, True])
def test_the_warm_up_compiles_what_the_first_real_calls_need(model_dir, tmp_path, monkeypatch, zorro):
    """torch_compile=layers with Dynamo's counting backend (eager graphs): the warm-up compiles; a real batch of
    other sizes then compiles no new graph, in /forward-backward (grad) nor /forward (eval, no grad)."""
    counter = counting_compiles(monkeypatch)

    def counted_token_stats(enabled: bool) -> None:  # the fused chunks, compiled as the server does, counted
        fns = {"stats": token_logprobs._chunk_stats, "grad": token_logprobs._chunk_grad}
        if enabled:
            fns = {k: token_logprobs.compile_chunk_fn(f, backend=counter) for k, f in fns.items()}
        token_logprobs._CHUNK_FNS.update(fns)

    monkeypatch.setattr(training_mod, "set_compiled_token_stats", counted_token_stats)
    torch._dynamo.reset()
    engine = _training(model_dir, tmp_path, "compiled", zorro=zorro, torch_compile="layers")
    try:
        assert engine.torch_compile == "layers" and warmup.warm_up_wanted(engine, ServerSettings())
        assert counter.frame_count == 0
        assert warmup.warm_up(engine, ServerSettings()) is not None
        compiled = counter.frame_count
        assert compiled > 0
        # real batches: padded responses (verl's), and several fp32 chunks per pass (16 rows of 9 positions: 6, 6, 4)
        monkeypatch.setattr(token_logprobs, "_FP32_CHUNK_BYTES", 6 * REAL_SHAPE[3] * engine.vocab_size * 4)
        _first_step(engine, zorro)
        assert counter.frame_count == compiled, "a real batch recompiled after the warm-up (plain LM head)"
        # logits above one head chunk (as SmolLM2's 16 x 128 response positions are on a GPU): the chunked head
        monkeypatch.setattr(token_logprobs, "_HEAD_CHUNK_BYTES", 10 * engine.vocab_size * 4)
        _first_step(engine, zorro, entropy=False)  # an old-log-prob /forward that asks no entropy
        assert counter.frame_count == compiled, "a real batch recompiled after the warm-up (chunked LM head)"
    finally:
        engine.close()
        token_logprobs.set_compiled_token_stats(False)
        torch._dynamo.reset()


def test_the_warm_up_runs_each_call_at_the_client_batch_shape(model_dir, tmp_path, monkeypatch):
    """Beside the synthetic batches, one /forward-backward (``gas`` micro-batches of the mini-batch's rows) and the
    two /forward (with and without entropy) at the sizes the client said it sends, in groups of ``rollout_n``;
    then the job is as it was."""
    engine = _training(model_dir, tmp_path, "client", gas=2, worker={"rollout_n": 4, "batch_shape": CLIENT_SHAPE})
    try:
        assert warmup.client_shapes(engine) == ((1, 4, 30, 7), (4, 4, 30, 7))
        seen: list[tuple] = []
        for name in ("forward", "forward_backward"):
            call = getattr(engine, name)
            monkeypatch.setattr(engine, name, lambda batch, _call=call, _name=name: (
                seen.append((_name, batch.rows, batch.prompt_len, batch.response_len, batch.meta.calculate_entropy)),
                _call(batch))[1])
        before = _state(engine)
        assert warmup.warm_up(engine, ServerSettings(warm_up="on")) is not None
        _assert_same(before, _state(engine))
        assert len(seen) == 15 and seen[-3:] == [("forward_backward", 8, 30, 7, False), ("forward", 16, 30, 7, True),
                                                ("forward", 16, 30, 7, False)]
        assert {prompt for _, _, prompt, *_ in seen[:-3]} == {6, 130}  # the synthetic batches first
    finally:
        engine.close()


def test_client_shapes_that_cannot_be_run_as_given(caplog):
    """Rows that ``rollout_n`` does not divide form groups of one; a mini-batch that does not split into the job's
    micro-batches, or a call over :data:`WARM_UP_MAX_TOKENS` tokens, is not warmed (logged); a log_prob job takes
    no /forward-backward."""
    from types import SimpleNamespace

    from arctic_rl.protocol import BatchShape

    def engine(job_type, gas=1, n=4, **shape):
        knobs = SimpleNamespace(rollout_n=n, batch_shape=BatchShape(**{**CLIENT_SHAPE, **shape}))
        return SimpleNamespace(job_type=job_type, gas=gas, knobs=knobs)

    assert warmup.client_shapes(engine(JobType.TRAINING, forward_rows=18)) == ((2, 4, 30, 7), (18, 1, 30, 7))
    assert warmup.client_shapes(engine(JobType.LOG_PROB)) == (None, (4, 4, 30, 7))
    assert warmup.client_shapes(SimpleNamespace(job_type=JobType.TRAINING, gas=1, knobs=SimpleNamespace(
        rollout_n=4, batch_shape=None))) == (None, None)
    with caplog.at_level("WARNING", logger="arctic_rl.server"):
        assert warmup.client_shapes(engine(JobType.TRAINING, gas=3)) == (None, (4, 4, 30, 7))
        long = warmup.WARM_UP_MAX_TOKENS // 8  # x 8 rows of a /forward-backward: over the bound, with the response
        assert warmup.client_shapes(engine(JobType.TRAINING, prompt_len=long)) == (None, None)
    assert "8 rows do not split into gradient_accumulation_steps=3" in caplog.text
    assert f"/forward at the client's batch shape: 16 rows x {long + 7} tokens exceed" in caplog.text


@pytest.mark.slow
def test_a_size_guard_compiles_in_the_warm_up_at_the_client_batch_shape(model_dir, tmp_path, monkeypatch):
    """A compiled graph may branch on a batch's size (as inductor picks kernels by ``rows x tokens``): Dynamo then
    guards on it, and a real batch beyond the synthetic sizes recompiled in verl's first step. With the client's
    ``batch_shape`` the warm-up compiles that branch too: the first real calls compile nothing."""
    counter = counting_compiles(monkeypatch)
    tokens_limit = 4096  # above the synthetic batches' rows x tokens (15 x 220), below the client's (16 x 300)

    def run(worker: dict) -> tuple[int, int]:
        torch._dynamo.reset()
        engine = _training(model_dir, tmp_path, f"guard{len(worker)}", torch_compile="layers", worker=worker)
        mlp = type(next(m for name, m in engine.model.named_modules() if name.endswith(".mlp")))
        forward = mlp.forward

        def size_branch(self, x):  # both branches give the same values; Dynamo guards on the condition
            out = forward(self, x)
            return out.clone() if x.shape[:-1].numel() > tokens_limit else out

        monkeypatch.setattr(mlp, "forward", size_branch)
        try:
            warmup.warm_up(engine, ServerSettings())
            compiled = counter.frame_count
            body = warmup.synthetic_body(engine.vocab_size, (4, 4, 280, 20), train=False, zorro=False, seed=9)
            engine.forward(parse_batch_body(body, vocab_size=engine.vocab_size, train=False))
            return compiled, counter.frame_count - compiled
        finally:
            monkeypatch.setattr(mlp, "forward", forward)
            engine.close()
            torch._dynamo.reset()

    shape = {**CLIENT_SHAPE, "prompt_len": 280, "response_len": 20}
    assert run({})[1] > 0  # the synthetic sizes alone: the real batch takes the other branch and recompiles
    assert run({"rollout_n": 4, "batch_shape": shape})[1] == 0


def _verl_batch(engine, *, groups: int, n: int, prompt_len: int, response_len: int, train: bool, left_pad: bool,
                seed: int):
    """A batch as verl sends it: ``groups`` prompts of ``n`` rows (the second a copy of the first, so one prompt
    fewer than groups is unique), prompts left-padded by 0-9 tokens (``left_pad``; else full-length), responses
    right-padded to lengths of 3 and more."""
    body = warmup.synthetic_body(engine.vocab_size, (groups, n, prompt_len, response_len), train=train, zorro=True,
                                 seed=seed)
    batch, g = body["batch"], torch.Generator().manual_seed(seed)
    batch["input_ids"][n:2 * n, :prompt_len] = batch["input_ids"][:n, :prompt_len]
    batch["prompts"][n:2 * n] = batch["prompts"][:n]
    for group in range(2, groups) if left_pad else ():
        short, rows = int(torch.randint(0, 10, (1,), generator=g)), slice(group * n, (group + 1) * n)
        for key in ("input_ids", "attention_mask", "prompts"):
            batch[key][rows, :short] = 0
    for row in range(groups * n):
        length = int(torch.randint(3, response_len + 1, (1,), generator=g))
        batch["attention_mask"][row, prompt_len + length:] = 0
        batch["response_mask"][row, length:] = 0
    return parse_batch_body(body, vocab_size=engine.vocab_size, train=train)


@pytest.mark.slow
def test_verl_shaped_calls_in_the_zorro_tuner_order_compile_nothing_after_the_warm_up(model_dir, tmp_path,
                                                                                       monkeypatch):
    """A ZoRRO job at verl's sizes (``batch_shape``; ``max_token_len`` chunks of /forward; micro-batches), then the
    calls of verl's first steps in the tuner's order -- ZoRRO's /forward and /forward-backward, then the plain
    pass's -- on batches with left-padded prompts and with full-length ones: no call compiles. (On an H100 the
    first ZoRRO calls recompiled the masked prompt pass, met at one size in the warm-up, and the first plain calls
    after them the attention frames a plain pass enters after ZoRRO's, benchmarks/RESULTS.md §2zb.)"""
    counter = counting_compiles(monkeypatch)
    torch._dynamo.reset()
    groups, n, prompt_len, response_len, gas = 8, 4, 60, 10, 4
    shape = {"prompt_len": prompt_len, "response_len": response_len, "forward_rows": groups * n,
             "forward_backward_rows": groups * n}
    engine = _training(model_dir, tmp_path, "tuner_order", zorro=True, gas=gas, torch_compile="layers", worker={
        "rollout_n": n, "batch_shape": shape, "max_token_len": 10 * (prompt_len + response_len)})
    decoder = engine.model.model  # the stack of layers: one call per pass over them
    layers = len(decoder.layers)
    stack_calls = []
    decoder.register_forward_pre_hook(lambda module, args: stack_calls.append(1))
    try:
        warmup.warm_up(engine, ServerSettings())
        compiled, seed = counter.frame_count, 20
        for left_pad in (True, False):
            for zorro in (True, False):
                engine.zorro_planners = {call: ZorroPlanner("tuner order", call, min_saving=0.0 if zorro else 99.0,
                                                            trials=0) for call in ("/forward", "/forward-backward")}
                for train in (False, True):
                    seed += 1
                    batch = _verl_batch(engine, groups=groups, n=n, prompt_len=prompt_len,
                                        response_len=response_len, train=train, left_pad=left_pad, seed=seed)
                    runs, stacks = counter.runs, len(stack_calls)
                    (engine.forward_backward if train else engine.forward)(batch)
                    runs, stacks = counter.runs - runs, len(stack_calls) - stacks
                    engine.discard_gradients()
                    engine.pending = 0
                    what = f"{'/forward-backward' if train else '/forward'}, {'ZoRRO' if zorro else 'plain'} pass, " \
                           f"{'left-padded' if left_pad else 'full-length'} prompts"
                    assert counter.frame_count == compiled, f"{what}: compiled after the warm-up"
                    # a plain pass runs one graph per layer; ZoRRO's wrapper splits a layer in two (its graph break)
                    assert stacks > 0 and runs == stacks * layers * (2 if zorro else 1), (what, runs, stacks)
    finally:
        engine.close()
        torch._dynamo.reset()


def test_the_warm_up_times_its_parts_for_the_log():
    """The log line's parts: each round's seconds, and the calls at the client's shape counted across the rounds."""
    synchronised: list[int] = []
    times = PartTimes(lambda: synchronised.append(1))  # a part's end waits for the device's queued work
    assert warmup._parts_text(times) == ""
    times.seconds.update({"plain pass": 80.06, "ZoRRO's pass": 110.2, "a part not a round": 44.6})
    assert warmup._parts_text(times) == "plain pass 80.1s, ZoRRO's pass 110.2s"  # the rounds, in their order
    for _ in range(2):  # a part's seconds add up
        with times.part("at the client's shape"):
            pass
    assert 0 <= times.seconds["at the client's shape"] < 1 and len(synchronised) == 2
    assert warmup._parts_text(times).startswith("plain pass 80.1s, ZoRRO's pass 110.2s; "
                                                "0.0s of it at the client's shape")


def test_the_setting_and_the_flag(model_dir, tmp_path):
    assert WARM_UP_MODES == ("auto", "on", "off") and ServerSettings().warm_up == "auto"
    with pytest.raises(ValueError, match=r"warm_up: expected one of \['auto', 'on', 'off'\], got 'yes'"):
        ServerSettings(warm_up="yes")
    assert parse_args([]).warm_up == "auto" and parse_args(["--warm-up", "off"]).warm_up == "off"
    with pytest.raises(SystemExit):
        parse_args(["--warm-up", "yes"])
    engine = _training(model_dir, tmp_path, "auto")  # CPU: torch_compile auto resolves to off
    try:
        assert engine.torch_compile == "off"
        assert not warmup.warm_up_wanted(engine, ServerSettings())
        assert warmup.warm_up_wanted(engine, ServerSettings(warm_up="on"))
        engine.torch_compile = "layers"
        assert warmup.warm_up_wanted(engine, ServerSettings())
        assert not warmup.warm_up_wanted(engine, ServerSettings(warm_up="off"))
    finally:
        engine.close()


def test_auto_warms_a_log_prob_job_once_the_process_runs_compiled_passes(model_dir):
    from arctic_rl.server.zorro.flex import set_response_attention

    engine = LogProbEngine(JobConfig(model_name=str(model_dir), job_type=JobType.LOG_PROB), ServerSettings())
    try:
        assert not warmup.compiled_paths_on() and not warmup.warm_up_wanted(engine, ServerSettings())
        assert warmup.warm_up(engine, ServerSettings()) is None and engine.info()["warm_up_s"] is None
        set_response_attention("flex")  # what a compiled training job on a GPU turns on (reset after each test)
        assert warmup.compiled_paths_on() and warmup.warm_up_wanted(engine, ServerSettings())
        set_response_attention("expand")
        token_logprobs.set_compiled_token_stats(True)
        assert warmup.warm_up_wanted(engine, ServerSettings())
        assert not warmup.warm_up_wanted(engine, ServerSettings(warm_up="off"))
    finally:
        token_logprobs.set_compiled_token_stats(False)
        set_response_attention("expand")
        engine.close()


def test_a_job_warms_up_when_the_server_creates_it(model_dir, tmp_path, caplog):
    """``/initialize`` (:meth:`ServerState.initialize`) starts the warm-up; the job's info reports its seconds."""
    import asyncio

    from arctic_rl.server.jobs.service import ServerState

    async def create(settings: ServerSettings) -> dict:
        state = ServerState(settings)
        config = JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING, checkpoint_path="train",
                           ds_config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                           ds_worker_config={"rollout_n": 2, "batch_shape": CLIENT_SHAPE})
        job_id = (await state.initialize(config))["job_id"]
        try:
            await state.setups.idle()  # the warm-up runs once /initialize has answered (jobs.background_setup)
            return state.job_info(job_id)
        finally:
            await state.destroy(job_id, None)
            state.shutdown()

    with caplog.at_level("INFO", logger="arctic_rl.server"):
        info = asyncio.run(create(ServerSettings(checkpoint_root=tmp_path / "on", warm_up="on")))
    assert info["warm_up_s"] > 0 and info["global_step"] == 0 and info["pending_forward_backward"] == 0
    assert ("training job: warm-up of 15 calls on synthetic batches and at the client's batch shape "
            "(/forward-backward micro-batches of 8 rows x 30 + 7, /forward 16 rows x 30 + 7)") in caplog.text
    assert re.search(r"16 rows x 30 \+ 7\) in [0-9.]+s \(plain pass [0-9.]+s; [0-9.]+s of it at the client's shape; "
                     r"compiles before step 1\)", caplog.text)
    assert asyncio.run(create(ServerSettings(checkpoint_root=tmp_path / "auto")))["warm_up_s"] is None  # CPU: eager
