"""The server's ZoRRO rule: a ZoRRO request takes the ZoRRO pass only where deduplicating prompts pays.

Unit tests of :func:`arctic_rl.server.zorro.rule.choose_zorro` (token counts, per-pass grouping, both
branches at the threshold) and, against a real server process started with ``--zorro-min-saving 0.55``,
both branches end to end: a batch with a long prompt shared by its group takes the ZoRRO pass, one with
short prompts the plain pass, and in either case ``/forward``'s log-probs and ``/forward-backward``'s
loss and gradient equal those of the same call with ZoRRO off; the metrics and the server log say which
pass ran.
"""

from __future__ import annotations

import contextlib

import pytest
import requests
import torch

from arctic_rl.server.__main__ import parse_args
from arctic_rl.server.settings import ServerSettings
from arctic_rl.server.zorro.rule import DEFAULT_MIN_SAVING, ZorroChoiceLog, choose_zorro, row_slices
from tests.support.server import check_server_flag, decode, make_batch, post_frame, running_server

torch.set_num_threads(1)


def _batch(groups: int, n: int, prompt_len: int, response_len: int):
    prompts = [[5 + g] * prompt_len for g in range(groups) for _ in range(n)]
    responses = [[20 + (i % 7)] * response_len for i in range(groups * n)]
    return make_batch(prompts, responses)


def test_saving_is_the_share_of_plain_tokens_zorro_skips():
    b = _batch(groups=2, n=4, prompt_len=32, response_len=8)  # B=8, U=2, P=32, R=8
    choice = choose_zorro(b["input_ids"], b["attention_mask"], 32, min_saving=0.55)
    assert (choice.rows, choice.unique_prompts, choice.prompt_len, choice.response_len) == (8, 2, 32, 8)
    assert choice.plain_tokens == 8 * 40 and choice.zorro_tokens == 2 * 32 + 8 * 8
    assert choice.saving == pytest.approx(1 - 128 / 320)  # 0.6
    assert choice.use_zorro and choice.metrics() == {"zorro_applied": 1.0, "zorro_token_saving": pytest.approx(0.6)}


def test_below_the_threshold_the_plain_pass_is_taken():
    b = _batch(groups=2, n=4, prompt_len=32, response_len=8)
    assert not choose_zorro(b["input_ids"], b["attention_mask"], 32, min_saving=0.61).use_zorro
    assert choose_zorro(b["input_ids"], b["attention_mask"], 32, min_saving=0.6).use_zorro  # >= takes ZoRRO
    assert choose_zorro(b["input_ids"], b["attention_mask"], 32, min_saving=0.0).use_zorro


def test_the_shape_of_the_gpu_loop_benchmark_takes_the_plain_pass():
    """256-token prompts, 512-token responses, n=8 (benchmarks/RESULTS.md §2c): ZoRRO saves 29%, which measured
    slower there; 2K-token prompts save 70% and take ZoRRO."""
    short = _batch(groups=2, n=8, prompt_len=256, response_len=512)
    choice = choose_zorro(short["input_ids"], short["attention_mask"], 256, min_saving=DEFAULT_MIN_SAVING)
    assert choice.saving == pytest.approx(0.29, abs=0.01) and not choice.use_zorro
    long = _batch(groups=2, n=8, prompt_len=2048, response_len=512)
    choice = choose_zorro(long["input_ids"], long["attention_mask"], 2048, min_saving=DEFAULT_MIN_SAVING)
    assert choice.saving == pytest.approx(0.70, abs=0.01) and choice.use_zorro


def test_unique_prompts_are_counted_per_pass():
    """A group split over two micro-batches is run (and counted) once in each."""
    b = _batch(groups=2, n=4, prompt_len=16, response_len=4)
    whole = choose_zorro(b["input_ids"], b["attention_mask"], 16, min_saving=0.5)
    split = choose_zorro(b["input_ids"], b["attention_mask"], 16, min_saving=0.5, passes=[(0, 2), (2, 6), (6, 8)])
    assert whole.unique_prompts == 2 and split.unique_prompts == 4
    assert split.saving < whole.saving
    assert row_slices(8, 3) == [(0, 3), (3, 6), (6, 8)]
    with pytest.raises(ValueError, match="step: expected >= 1"):
        row_slices(8, 0)


def test_the_choice_is_logged_when_the_path_changes(caplog):
    b = _batch(groups=2, n=4, prompt_len=32, response_len=8)
    log = ZorroChoiceLog("training")
    with caplog.at_level("DEBUG", logger="arctic_rl.server.zorro.rule"):
        for min_saving in (0.5, 0.5, 0.9):
            log.record("/forward", choose_zorro(b["input_ids"], b["attention_mask"], 32, min_saving=min_saving))
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(infos) == 2 and "ZoRRO pass" in infos[0] and "plain pass" in infos[1]
    assert "saving 60% >= --zorro-min-saving 50%" in infos[0]


def test_bad_thresholds_are_refused_naming_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="zorro_min_saving: expected a share between 0 and 1"):
        ServerSettings(zorro_min_saving=1.5)
    assert ServerSettings().zorro_min_saving == DEFAULT_MIN_SAVING
    check_server_flag(monkeypatch, "--zorro-min-saving", "ARCTIC_RL_ZORRO_MIN_SAVING", bad="-0.1", good=("0.2", 0.2),
                      from_env=("0.7", 0.7), bad_env="lots")


# ---------------------------------------------------------------------------------------------------------------
# Both branches through a real server
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _training_job(srv, model_dir, gas: int = 1):
    config = {
        "model_name": str(model_dir),
        "job_type": "training",
        "checkpoint_path": "rule",
        "ds_config": {
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}},
            "gradient_clipping": 0.0,
        },
    }
    info = decode(requests.post(srv.url + "/initialize", json=config, timeout=300))
    try:
        yield info["job_id"]
    finally:
        requests.post(f"{srv.url}/destroy?job_id={info['job_id']}", json={"job_type": "training"}, timeout=60)


def _body(batch, zorro: bool, loss_config: dict | None = None, meta: dict | None = None) -> dict:
    return {"batch": batch, "meta": {"zorro_train_enable": zorro, "temperature": 1.0, **(meta or {})},
            "processing": {"loss_fn": "grpo", "config": loss_config or {}}}


SHAPES = {
    # 2 prompts of 24 tokens, each sampled 4 times, 3-token responses: ZoRRO saves 67%
    "long_shared_prompt": {"groups": 2, "n": 4, "prompt_len": 24, "response_len": 3, "zorro": True},
    # 2 prompts of 4 tokens, each sampled twice, 4-token responses: ZoRRO would save 25%
    "short_prompt": {"groups": 2, "n": 2, "prompt_len": 4, "response_len": 4, "zorro": False},
}


@pytest.fixture(scope="module")
def rule_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("rule_server"), extra_args=("--zorro-min-saving", "0.55")) as srv:
        yield srv


@pytest.fixture(scope="module")
def calls(rule_server, tiny_model_dir) -> dict:
    out = {}
    with _training_job(rule_server, tiny_model_dir) as jid:
        for name, shape in SHAPES.items():
            batch = _batch(shape["groups"], shape["n"], shape["prompt_len"], shape["response_len"])
            gen = torch.Generator().manual_seed(1)
            batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=gen) * batch["response_mask"]
            batch["old_log_probs"] = torch.zeros(batch["input_ids"].shape)
            res = {"batch": batch}
            for zorro in (True, False):
                res[("forward", zorro)] = decode(post_frame(rule_server, f"/forward?job_id={jid}", _body(batch, zorro)))
                metrics = decode(post_frame(rule_server, f"/forward-backward?job_id={jid}", _body(batch, zorro)))
                grad = decode(requests.post(f"{rule_server.url}/step?job_id={jid}", json={}, timeout=120))
                res[("update", zorro)] = (metrics["metrics"], grad["metrics"]["grad_norm"])
            out[name] = res
    out["log"] = "\n".join(p.read_text(errors="replace") for p in rule_server.log_dir.glob("*.log"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_forward_takes_the_chosen_pass_with_the_plain_log_probs(calls, name):
    shape, res = SHAPES[name], calls[name]
    on, off = res[("forward", True)], res[("forward", False)]
    assert on["metrics"]["zorro_applied"] == float(shape["zorro"])
    assert "zorro_applied" not in off["metrics"]  # ZoRRO not asked for: no choice made
    p, r = shape["prompt_len"], shape["response_len"]
    rows = shape["groups"] * shape["n"]
    want_tokens = shape["groups"] * p + rows * r if shape["zorro"] else rows * (p + r)
    assert on["metrics"]["tokens_computed"] == want_tokens
    # ZoRRO requested: response-aligned layout whichever pass ran; off: shifted
    got = on["batch"]["logprobs"][:, p:]
    want = off["batch"]["logprobs"][:, p - 1 : p - 1 + r]
    mask = res["batch"]["response_mask"][:, p:].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_update_takes_the_chosen_pass_with_the_plain_loss_and_gradient(calls, name):
    shape, res = SHAPES[name], calls[name]
    (m_on, g_on), (m_off, g_off) = res[("update", True)], res[("update", False)]
    assert m_on["zorro_applied"] == float(shape["zorro"])
    assert m_on["loss"] == pytest.approx(m_off["loss"], abs=1e-5)
    assert g_off > 0 and g_on == pytest.approx(g_off, rel=1e-4)
    if shape["zorro"]:
        assert m_on["tokens_computed"] < m_off["tokens_computed"]
    else:
        assert m_on["tokens_computed"] == m_off["tokens_computed"]


@pytest.mark.slow
def test_the_server_log_names_each_choice(calls):
    assert "training job, /forward: ZoRRO pass" in calls["log"]
    assert "training job, /forward: plain pass" in calls["log"]
    assert "saving 25% < --zorro-min-saving 55%" in calls["log"]


def test_the_adapter_passes_its_threshold_to_a_local_server():
    """``remote_backend.server.local.zorro_min_saving``: null keeps the server's default; a share becomes the
    flag; anything else is refused naming the key."""
    from verl.remote_backend.errors import RemoteBackendConfigError
    from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
    from verl.workers.remote_client.arctic.local_server import _extra_args

    assert _extra_args(ArcticConfig.from_dict({}).server.local) == ()
    local = ArcticConfig.from_dict({"server": {"local": {"zorro_min_saving": 0.3}}}).server.local
    assert _extra_args(local) == ("--zorro-min-saving", "0.3")
    assert parse_args(list(_extra_args(local))).zorro_min_saving == 0.3
    with pytest.raises(RemoteBackendConfigError, match=r"server\.local\.zorro_min_saving.*1\.5"):
        ArcticConfig.from_dict({"server": {"local": {"zorro_min_saving": 1.5}}})


# ---------------------------------------------------------------------------------------------------------------
# The timing of both passes (arctic_rl/server/zorro/tuner.py) through a real server
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_job_times_both_passes_and_keeps_the_faster_with_the_same_numbers(tmp_path, tiny_model_dir):
    """``--zorro-trials 1``: the calls the rule sends to ZoRRO run ZoRRO, plain, ZoRRO, plain (two warm-ups, one
    timed call each), then the faster pass; every call gives the same loss, gradient and log-probs (lr 0)."""
    shape = SHAPES["long_shared_prompt"]
    batch = _batch(shape["groups"], shape["n"], shape["prompt_len"], shape["response_len"])
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(1))
    batch["advantages"] *= batch["response_mask"]
    batch["old_log_probs"] = torch.zeros(batch["input_ids"].shape)
    args = ("--zorro-min-saving", "0.55", "--zorro-trials", "1")
    with running_server(tmp_path, extra_args=args) as srv, _training_job(srv, tiny_model_dir) as jid:
        updates, forwards = [], []
        for _ in range(6):
            metrics = decode(post_frame(srv, f"/forward-backward?job_id={jid}", _body(batch, True)))["metrics"]
            grad = decode(requests.post(f"{srv.url}/step?job_id={jid}", json={}, timeout=120))["metrics"]["grad_norm"]
            updates.append((metrics, grad))
            forwards.append(decode(post_frame(srv, f"/forward?job_id={jid}", _body(batch, True))))
        log = "\n".join(p.read_text(errors="replace") for p in srv.log_dir.glob("*.log"))
    for calls in ([m for m, _ in updates], [f["metrics"] for f in forwards]):
        applied = [m["zorro_applied"] for m in calls]
        assert applied[:4] == [1.0, 0.0, 1.0, 0.0]
        assert all("zorro_time_ratio" not in m for m in calls[:3])
        assert all(m["zorro_time_ratio"] > 0 for m in calls[3:])
        # each later call takes the pass the timings so far favour (the ratio reported by the call before it;
        # each call's own time updates the ratio, so on a noisy machine the verdict may change between calls)
        assert applied[4:] == [float(m["zorro_time_ratio"] <= 1.0) for m in calls[3:5]]
        tokens = {m["tokens_computed"] for m in calls}
        assert len(tokens) == 2  # the two passes' token counts
    first_metrics, first_grad = updates[0]
    for metrics, grad in updates[1:]:
        assert metrics["loss"] == pytest.approx(first_metrics["loss"], abs=1e-5)
        assert grad == pytest.approx(first_grad, rel=1e-4)
    mask = batch["response_mask"].bool()
    for f in forwards[1:]:
        torch.testing.assert_close(f["batch"]["logprobs"][mask], forwards[0]["batch"]["logprobs"][mask],
                                   atol=1e-5, rtol=1e-5)
    assert "training job, /forward-backward: timed" in log and "training job, /forward: timed" in log


# ---------------------------------------------------------------------------------------------------------------
# ZoRRO's passes hold several plain passes' rows (arctic_rl/server/zorro/passes.py) through a real server
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_zorro_merges_micro_batches_with_the_same_loss_and_gradient(rule_server, tiny_model_dir, loss_agg_mode):
    """4 prompts x 4 samples with 24-token prompts, ``gradient_accumulation_steps=4`` (one prompt per 4-row
    micro-batch, 108 plain tokens each): ZoRRO runs the first three micro-batches in one pass (108 ZoRRO
    tokens) and the last alone, with the loss, gradient norm and metrics of the plain micro-batches; a
    ``/forward`` bounded to 108 tokens runs ZoRRO in 2 passes where the plain pass takes 4 of 4 rows."""
    batch = _batch(4, 4, 24, 3)
    gen = torch.Generator().manual_seed(3)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=gen) * batch["response_mask"]
    batch["old_log_probs"] = -torch.rand(batch["input_ids"].shape, generator=gen) * batch["response_mask"]
    loss_config = {"loss_agg_mode": loss_agg_mode}
    results = {}
    with _training_job(rule_server, tiny_model_dir, gas=4) as jid:
        for zorro in (True, False):
            body = _body(batch, zorro, loss_config)
            metrics = decode(post_frame(rule_server, f"/forward-backward?job_id={jid}", body))["metrics"]
            grad = decode(requests.post(f"{rule_server.url}/step?job_id={jid}", json={}, timeout=120))["metrics"]
            fwd = decode(post_frame(rule_server, f"/forward?job_id={jid}",
                                    _body(batch, zorro, meta={"max_token_len_per_gpu": 108})))
            results[zorro] = (metrics, grad["grad_norm"], fwd)
    (m_on, g_on, f_on), (m_off, g_off, f_off) = results[True], results[False]
    assert m_on["zorro_applied"] == 1.0 and m_on["passes"] == 2.0 and m_off["passes"] == 4.0
    assert m_on["micro_batches"] == m_off["micro_batches"] == 4.0
    assert m_on["tokens_computed"] == 4 * 24 + 16 * 3 and m_off["tokens_computed"] == 16 * 27
    assert g_off > 0 and g_on == pytest.approx(g_off, rel=1e-4)
    for name in ("loss", "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac"):
        if name in m_off:
            assert m_on[name] == pytest.approx(m_off[name], abs=1e-5), name
    assert f_on["metrics"]["passes"] == 2.0 and f_off["metrics"]["passes"] == 4.0
    p = 24
    mask = batch["response_mask"][:, p:].bool()
    torch.testing.assert_close(f_on["batch"]["logprobs"][:, p:][mask], f_off["batch"]["logprobs"][:, p - 1 : p + 2][mask],
                               atol=1e-5, rtol=1e-5)
