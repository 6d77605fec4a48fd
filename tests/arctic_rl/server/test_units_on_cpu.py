"""Unit tests of the reference server's pure parts (no server process): idempotency, checkpoint
path safety, DeepSpeed-config building, body validation, auth, the sampler's filters."""

import asyncio
import os
import pathlib
import pickle
import sys

import pytest
import torch

from arctic_rl.protocol import LOSS_NAMES, POST_PROCESSORS, REQUIRED_TRAIN_TENSORS, SamplingParams
from arctic_rl.server.engines.config import build_training_ds_config, parse_worker_knobs
from arctic_rl.server.engines.generation import sample_next
from arctic_rl.server.errors import ApiError, BadRequest, Conflict, NotFound
from arctic_rl.server.http.auth import token_matches
from arctic_rl.server.http.idempotency import CachedResponse, IdempotencyCache, payload_hash
from arctic_rl.server.http.validation import parse_batch_body
from arctic_rl.server.jobs import checkpoint as ckpt
from arctic_rl.server.settings import is_loopback_host
from tests.support.server import make_batch

# --------------------------------------------------------------------------- idempotency


def _run(coro):
    return asyncio.run(coro)


def test_idempotency_replays_once_and_conflicts_on_other_payload():
    cache = IdempotencyCache(capacity=4)
    calls = []

    async def compute():
        calls.append(1)
        return CachedResponse(200, f"r{len(calls)}".encode(), "text/plain")

    async def scenario():
        first, replayed1 = await cache.run("job:1", "abc", "h1", compute)
        again, replayed2 = await cache.run("job:1", "abc", "h1", compute)
        other_scope, _ = await cache.run("job:2", "abc", "h1", compute)
        with pytest.raises(Conflict):
            await cache.run("job:1", "abc", "h2", compute)
        no_id, _ = await cache.run("job:1", None, "", compute)
        return first, replayed1, again, replayed2, other_scope, no_id

    first, replayed1, again, replayed2, other_scope, no_id = _run(scenario())
    assert (first.body, replayed1, again.body, replayed2) == (b"r1", False, b"r1", True)
    assert other_scope.body == b"r2" and no_id.body == b"r3" and len(calls) == 3


def test_idempotency_forgets_failures_and_waits_for_in_flight():
    cache = IdempotencyCache()
    attempts = []

    async def failing():
        attempts.append("fail")
        raise BadRequest("nope")

    async def slow():
        attempts.append("slow")
        await asyncio.sleep(0.05)
        return CachedResponse(200, b"done", "text/plain")

    async def scenario():
        with pytest.raises(BadRequest):
            await cache.run("s", "id", "h", failing)
        # the failure is forgotten: a retry computes; a concurrent duplicate waits for it
        results = await asyncio.gather(cache.run("s", "id", "h", slow), cache.run("s", "id", "h", slow))
        return results

    (a, ra), (b, rb) = _run(scenario())
    assert attempts == ["fail", "slow"]
    assert a.body == b.body == b"done" and sorted([ra, rb]) == [False, True]


def test_idempotency_capacity_evicts_oldest():
    cache = IdempotencyCache(capacity=2)

    async def scenario():
        count = 0

        async def compute():
            nonlocal count
            count += 1
            return CachedResponse(200, str(count).encode(), "text/plain")

        for rid in ("a", "b", "c"):
            await cache.run("s", rid, "h", compute)
        again_c, replay_c = await cache.run("s", "c", "h", compute)
        again_a, replay_a = await cache.run("s", "a", "h", compute)
        return again_c.body, replay_c, again_a.body, replay_a

    assert _run(scenario()) == (b"3", True, b"4", False)


def test_payload_hash_covers_path_query_and_body():
    base = payload_hash("POST", "/step", [("job_id", "1")], b"{}")
    assert base == payload_hash("post", "/step", [("job_id", "1")], bytearray(b"{}"))
    assert base != payload_hash("POST", "/step", [("job_id", "2")], b"{}")
    assert base != payload_hash("POST", "/save", [("job_id", "1")], b"{}")
    assert base != payload_hash("POST", "/step", [("job_id", "1")], b"{ }")


# --------------------------------------------------------------------------- checkpoint paths


def test_request_paths_stay_inside_the_root(tmp_path):
    root = (tmp_path / "root").resolve()
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    assert ckpt.resolve_request_path(root, "run/a") == root / "run" / "a"
    assert ckpt.resolve_request_path(root, str(root / "run")) == root / "run"
    for bad in ("../x", "run/../../x", str(outside), "escape", "escape/sub", "/etc", "a\x00b", ""):
        with pytest.raises(BadRequest) as err:
            ckpt.resolve_request_path(root, bad)
        assert err.value.field == "path"


def test_job_directory_maps_foreign_absolute_paths_under_the_root(tmp_path):
    root = tmp_path.resolve()
    assert ckpt.job_directory(root, None, "training") == root / "training"
    assert ckpt.job_directory(root, "runs/a", "training") == root / "runs" / "a"
    assert ckpt.job_directory(root, str(root / "x"), "training") == root / "x"
    assert ckpt.job_directory(root, "/data/run1", "training") == root / "data" / "run1"
    with pytest.raises(BadRequest):
        ckpt.job_directory(root, "../up", "training")


def test_find_latest_and_prune(tmp_path):
    root = tmp_path.resolve()
    base = root / "job"
    for step in (1, 2, 3):
        d = ckpt.checkpoint_dir(base, step)
        d.mkdir(parents=True)
        ckpt.write_marker(d, {"global_step": step})
    with pytest.raises(NotFound):
        ckpt.find_checkpoint(root, base, None)  # no latest pointer yet
    ckpt.write_latest(base, "checkpoint-2")
    assert ckpt.find_checkpoint(root, base, None) == base / "checkpoint-2"
    assert ckpt.find_checkpoint(root, base, 3) == base / "checkpoint-3"
    assert ckpt.find_checkpoint(root, base / "checkpoint-1", None) == base / "checkpoint-1"
    (base / "latest").write_text("3")  # the vendor's bare-step pointer
    assert ckpt.find_checkpoint(root, base, None) == base / "checkpoint-3"
    with pytest.raises(NotFound):
        ckpt.find_checkpoint(root, base, 7)
    removed = ckpt.prune_checkpoints(base, keep=1, protect=base / "checkpoint-3")
    assert sorted(p.name for p in removed) == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in base.iterdir() if p.is_dir()) == ["checkpoint-3"]


def test_rng_state_round_trip(tmp_path):
    import random

    ckpt.save_rng_state(tmp_path)
    expected = (torch.rand(3), random.random())
    torch.rand(5), random.random()
    assert ckpt.load_rng_state(tmp_path)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


# --------------------------------------------------------------------------- configs


def test_ds_config_for_cpu_golden():
    client = {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "flops_profiler": {"enabled": True},
    }
    out, notes = build_training_ds_config(client, device="cpu", bf16_supported=False)
    assert out == {
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-6, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 4,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": False},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "checkpoint": {"tag_validation": "Ignore"},  # one rank: DeepSpeed's check would compare a tag with itself
    }
    text = " ".join(notes)
    assert "flops_profiler" in text and "fp32" in text and "train_batch_size" in text
    gpu, _ = build_training_ds_config(client, device="cuda", bf16_supported=True)
    assert gpu["bf16"] == {"enabled": True} and gpu["data_types"] == {"grad_accum_dtype": "fp32"}
    gpu0, notes0 = build_training_ds_config(
        {**client, "zero_optimization": {"stage": 0}}, device="cuda", bf16_supported=True
    )
    # bf16 on one process: stage 0 runs as stage 1 (the flat BF16_Optimizer), and says so
    assert gpu0["bf16"] == {"enabled": True} and gpu0["data_types"] == {"grad_accum_dtype": "fp32"}
    assert gpu0["zero_optimization"]["stage"] == 1
    assert any("stage: 0 runs as 1 with bf16" in note for note in notes0)
    cpu0, notes_cpu0 = build_training_ds_config(
        {**client, "zero_optimization": {"stage": 0}}, device="cpu", bf16_supported=False
    )
    assert cpu0["zero_optimization"]["stage"] == 0 and not any("runs as 1" in note for note in notes_cpu0)


@pytest.mark.parametrize(
    "ds_config, field",
    [
        ({"optimizer": {"type": "SGD"}}, "ds_config.optimizer.type"),
        ({"optimizer": {"params": {"lr": -1}}}, "ds_config.optimizer.params.lr"),
        ({"optimizer": {"params": {"betas": [0.9]}}}, "ds_config.optimizer.params.betas"),
        ({"gradient_accumulation_steps": 0}, "ds_config.gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 1.5}, "ds_config.gradient_accumulation_steps"),
        ({"zero_optimization": {"stage": 4}}, "ds_config.zero_optimization.stage"),
        ({"scheduler": {"type": "OneCycle"}}, "ds_config.scheduler.type"),
    ],
)
def test_ds_config_rejects_with_field(ds_config, field):
    with pytest.raises(BadRequest) as err:
        build_training_ds_config(ds_config, device="cpu", bf16_supported=False)
    assert err.value.field == field


def test_worker_knobs():
    knobs, unused, unknown = parse_worker_knobs(
        {"zorro_train_enable": True, "logits_optimization": "memory", "use_liger": True, "my_knob": 1}
    )
    assert knobs.zorro_train_enable and knobs.logits_optimization == "memory"
    assert unused == ["use_liger"] and unknown == ["my_knob"]
    for bad in ({"zorro_train_enable": "perhaps"}, {"logits_optimization": "fast"}, {"rollout_n": 0}):
        with pytest.raises(BadRequest) as err:
            parse_worker_knobs(bad)
        assert err.value.field == f"ds_worker_config.{next(iter(bad))}"
    shape = {"prompt_len": 8, "response_len": 4, "forward_rows": 16, "forward_backward_rows": 8}
    assert parse_worker_knobs({"batch_shape": shape})[0].batch_shape.prompt_len == 8
    with pytest.raises(BadRequest) as err:
        parse_worker_knobs({"batch_shape": {**shape, "forward_backward_rows": -1}})
    assert err.value.field == "ds_worker_config.batch_shape.forward_backward_rows"


# --------------------------------------------------------------------------- body validation


def _body(**overrides):
    batch = make_batch([[5, 6, 7], [8, 9]], [[10, 11], [12]])
    batch["advantages"] = torch.ones(2, 5)
    batch["old_log_probs"] = torch.zeros(2, 5)
    body = {"batch": batch, "meta": {}, "processing": {"loss_fn": "grpo"}}
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            if value is None:
                body[section].pop(name)
            else:
                body[section][name] = value
        else:
            body[section] = value
    return body


def test_valid_body_is_response_sliced():
    parsed = parse_batch_body(_body(), vocab_size=100, train=True)
    assert (parsed.rows, parsed.prompt_len, parsed.response_len) == (2, 3, 2)
    assert parsed.rl["advantages"].shape == (2, 2) and parsed.rl["loss_mask"].dtype == torch.bool
    assert parsed.rl["response_mask"].tolist() == [[True, True], [True, False]]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"batch__advantages": None}, "batch.advantages"),
        ({"batch__input_ids": [[1, 2]]}, "batch.input_ids"),
        ({"batch__old_log_probs": torch.zeros(3, 5)}, "batch.old_log_probs"),
        ({"batch__advantages": torch.ones(2, 5, dtype=torch.int64)}, "batch.advantages"),
        ({"batch__advantages": torch.tensor([[1.0, float("nan"), 0, 0, 0], [0.0] * 5])}, "batch.advantages"),
        ({"batch__old_log_probs": torch.full((2, 5), float("inf"))}, "batch.old_log_probs"),
        ({"batch__advantages": torch.ones(2, 4)}, "batch.advantages"),
        ({"batch__attention_mask": torch.full((2, 5), 2)}, "batch.attention_mask"),
        ({"batch__position_ids": torch.zeros(2, 4, dtype=torch.long)}, "batch.position_ids"),
        ({"batch__input_ids": torch.zeros(2, 5, dtype=torch.float32)}, "batch.input_ids"),
        ({"processing__loss_fn": "os.system"}, "processing.loss_fn"),
        ({"processing__post": ["identity", "evil.module"]}, "processing.post"),
        ({"processing__config": {"clip_ratio": -1}}, "processing.config.clip_ratio"),
        ({"processing__config": {"use_kl_loss": True}}, "batch.ref_log_prob"),
        ({"processing__extra": 1}, "processing.extra"),
        ({"meta__rollout_n": 0}, "meta.rollout_n"),
        ({"batch": None}, "batch"),
    ],
)
def test_invalid_bodies_name_the_field(overrides, field):
    with pytest.raises(BadRequest) as err:
        parse_batch_body(_body(**overrides), vocab_size=100, train=True)
    assert err.value.field == field, err.value.message
    assert err.value.status_code == 400


def test_vocab_range_and_inconsistent_ids():
    with pytest.raises(BadRequest) as err:
        parse_batch_body(_body(), vocab_size=11, train=True)
    assert err.value.field == "batch.input_ids" and err.value.received == 12 and err.value.allowed == "[0, 11)"
    body = _body()
    body["batch"]["responses"] = body["batch"]["responses"].clone()
    body["batch"]["responses"][0, 0] = 3
    with pytest.raises(BadRequest, match="cat\\(prompts, responses\\)"):
        parse_batch_body(body, vocab_size=100, train=True)


def test_unknown_loss_lists_allowed_names():
    with pytest.raises(BadRequest) as err:
        parse_batch_body(_body(processing__loss_fn="my.module.loss"), vocab_size=100, train=True)
    assert err.value.allowed == list(LOSS_NAMES) and err.value.received == "my.module.loss"
    with pytest.raises(BadRequest) as err:
        parse_batch_body(_body(processing__post="nope"), vocab_size=100, train=False)
    assert err.value.allowed == list(POST_PROCESSORS)


def test_sft_needs_only_forward_tensors_and_forward_ignores_rl():
    body = _body(batch__advantages=None, batch__old_log_probs=None, batch__response_mask=None)
    body["processing"]["loss_fn"] = "sft"
    parsed = parse_batch_body(body, vocab_size=100, train=True)
    assert parsed.rl["loss_mask"].tolist() == [[True, True], [True, False]]  # from the attention mask
    with pytest.raises(BadRequest) as err:
        parse_batch_body(_body(processing__loss_fn="grpo", batch__old_log_probs=None), vocab_size=100, train=True)
    assert err.value.allowed == list(REQUIRED_TRAIN_TENSORS)


# --------------------------------------------------------------------------- small pieces


def test_token_matching():
    assert token_matches("Bearer s3cret", "s3cret") and token_matches("bearer s3cret", "s3cret")
    for header in (None, "", "s3cret", "Bearer wrong", "Basic s3cret", "Bearer s3cret2"):
        assert not token_matches(header, "s3cret")


def test_loopback_hosts():
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "192.0.2.1", "::", "example.com"))


def test_errors_are_picklable_and_shaped():
    err = pickle.loads(pickle.dumps(BadRequest("m", field="f", allowed=[1], received=2)))
    assert isinstance(err, ApiError) and err.detail() == {"message": "m", "field": "f", "allowed": [1], "received": 2}
    assert err.status_code == 400 and Conflict("x").status_code == 409


def test_sampler_filters():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 64)
    greedy, lp = sample_next(logits, SamplingParams(temperature=0), gen)
    assert greedy.tolist() == [1] * 64
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[:, 1])
    top1, _ = sample_next(logits, SamplingParams(temperature=1.0, top_k=1), gen)
    assert top1.tolist() == [1] * 64
    topp, lp = sample_next(logits, SamplingParams(temperature=2.0, top_p=0.6), gen)
    assert set(topp.tolist()) <= {1, 3} and len(set(topp.tolist())) == 2
    # the reported log-prob is under softmax(logits / T), before truncation
    expected = torch.log_softmax(logits / 2.0, -1).gather(-1, topp.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, expected)
    a = sample_next(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(5))[0]
    b = sample_next(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(5))[0]
    assert torch.equal(a, b)


@pytest.mark.slow
def test_app_import_pulls_in_neither_verl_nor_ray():
    import subprocess

    code = "import arctic_rl.server.app, sys; assert 'verl' not in sys.modules and 'ray' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[3]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.filterwarnings("ignore:Using `httpx`")
def test_unexpected_errors_are_json_500_and_the_app_keeps_serving(tmp_path):
    from fastapi.testclient import TestClient

    from arctic_rl.protocol import Features, HealthResponse
    from arctic_rl.server import ServerSettings, create_app

    app = create_app(ServerSettings(checkpoint_root=tmp_path))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
        assert response.status_code == 500
        assert "RuntimeError: kaput" in response.json()["detail"]["message"]
        health = HealthResponse.model_validate(client.get("/health").json())
        assert health.status == "OK" and health.protocol == 2 and len(health.instance_id) == 32
        # the reference server serves every capability the protocol defines
        defined = {value for name, value in vars(Features).items() if name.isupper()}
        assert len(defined) >= 10 and set(health.features) == defined
        assert client.get("/job/3").status_code == 404
        assert client.post("/step?job_id=1").json()["detail"]["field"] == "job_id"
