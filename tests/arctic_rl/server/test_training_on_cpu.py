"""The reference server's training and log_prob jobs, against a real server process.

Covers: SFT steps lower the loss and change the weights; ``/forward`` log-probs of both job
types equal a direct ``transformers`` computation (shifted and response-aligned, temperature,
entropy); ZoRRO on/off agree (log-probs, loss, gradient); one ``/forward-backward`` per mini-batch,
split into GAS micro-batches by the server (same gradient and token-mean metrics for GAS 1 and 2;
``meta.batch_num_tokens`` and ``meta.rollout_is_weights`` read as at the vendor); a second call before
``/step`` or a ``/step`` without a call is a 400; ``X-Request-Id`` replays apply once.
"""



import contextlib
import itertools

import pytest
import requests
import torch

from tests.support.server import decode, make_batch, post_frame

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
RESPONSES = [[20, 21, 22], [23, 24, 25, 26], [27]]


@contextlib.contextmanager
def job(srv, model_dir, job_type="training", *, gas=1, lr=1e-2, **extra):
    config = {
        "model_name": str(model_dir),
        "job_type": job_type,
        "checkpoint_path": "train",
        "ds_config": {
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
            "gradient_clipping": 0.0,
        },
        **extra,
    }
    info = decode(requests.post(srv.url + "/initialize", json=config, timeout=300))
    try:
        yield info["job_id"]
    finally:
        requests.post(f"{srv.url}/destroy?job_id={info['job_id']}", json={"job_type": job_type}, timeout=60)


def grpo_body(batch, *, loss_fn="grpo", zorro=False, config=None, temperature=1.0, entropy=False):
    return {
        "batch": batch,
        "meta": {"zorro_train_enable": zorro, "temperature": temperature, "calculate_entropy": entropy},
        # the vendor scales logits by meta.temperature only under the apply_temperature post-processor
        "processing": {"loss_fn": loss_fn, "config": config or {},
                       **({"post": ["apply_temperature"]} if temperature != 1.0 else {})},
    }


def rl_batch(prompts=PROMPTS, responses=RESPONSES, seed=0):
    batch = make_batch(prompts, responses)
    gen = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=gen) * batch["response_mask"]
    batch["old_log_probs"] = torch.zeros(batch["input_ids"].shape)
    return batch


def direct_shifted(model_dir, batch, temperature=1.0):
    """log p(ids[i+1] | <= i) and entropy with plain transformers, ``[B, T-1]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = (
            model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            )
            .logits[:, :-1]
            .float()
            / temperature
        )
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def forward(srv, job_id, body):
    return decode(post_frame(srv, f"/forward?job_id={job_id}", body))


def fwd_bwd(srv, job_id, body, headers=None):
    return post_frame(srv, f"/forward-backward?job_id={job_id}", body, headers=headers)


def step(srv, job_id, headers=None):
    return requests.post(f"{srv.url}/step?job_id={job_id}", json={}, headers=headers, timeout=120)


def to_response(shifted, prompt_len, response_len):
    return shifted[:, prompt_len - 1 : prompt_len - 1 + response_len]


def test_sft_steps_lower_the_loss_and_change_the_weights(reference_server, tiny_model_dir):
    batch = make_batch(PROMPTS, RESPONSES)
    body = grpo_body(batch, loss_fn="cross_entropy")
    with job(reference_server, tiny_model_dir, lr=2e-2) as jid:
        before = forward(reference_server, jid, body)["batch"]["logprobs"]
        losses, steps = [], []
        for _ in range(5):
            out = decode(fwd_bwd(reference_server, jid, body))
            losses.append(out["metrics"]["loss"])
            assert out["avg_loss"] == pytest.approx(out["metrics"]["loss"])
            assert out["metrics"]["num_tokens"] == float(batch["response_mask"].sum())
            metrics = decode(step(reference_server, jid))["metrics"]
            assert metrics["grad_norm"] > 0 and metrics["last_lr"] == pytest.approx(2e-2)
            steps.append(metrics["global_step"])
        after = forward(reference_server, jid, body)["batch"]["logprobs"]
    assert steps == [1, 2, 3, 4, 5]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    mask = batch["response_mask"][:, 1:].bool()
    assert (after[:, :-1][mask] - before[:, :-1][mask]).abs().max() > 1e-2  # the weights moved
    assert after[:, :-1][mask].mean() > before[:, :-1][mask].mean()  # toward the SFT targets


@pytest.mark.parametrize("job_type", ["training", "log_prob"])
def test_forward_matches_transformers(reference_server, tiny_model_dir, job_type):
    batch = make_batch(PROMPTS, RESPONSES)
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    lp_ref, ent_ref = direct_shifted(tiny_model_dir, batch, temperature=0.7)
    real = batch["response_mask"][:, 1:].bool()  # shifted positions whose target is a response token
    with job(reference_server, tiny_model_dir, job_type) as jid:
        shifted = forward(reference_server, jid, grpo_body(batch, temperature=0.7, entropy=True))
        aligned = forward(reference_server, jid, grpo_body(batch, zorro=True, temperature=0.7, entropy=True))
    assert shifted["logprob_alignment"] == "shifted" and aligned["logprob_alignment"] == "response"
    lp, ent = shifted["batch"]["logprobs"], shifted["batch"]["entropy"]
    assert lp.shape == ent.shape == batch["input_ids"].shape
    assert torch.all(lp[:, -1] == 0)
    assert torch.allclose(lp[:, :-1][real], lp_ref[real], atol=1e-5)
    assert torch.allclose(ent[:, :-1][real], ent_ref[real], atol=1e-5)
    resp_mask = batch["response_mask"][:, p:].bool()
    # the vendor's ZoRRO layout: [B, P+R], column P+j = response token j, zeros in the prompt columns
    assert aligned["batch"]["logprobs"].shape == (3, p + r) and (aligned["batch"]["logprobs"][:, :p] == 0).all()
    aligned_lp = aligned["batch"]["logprobs"][:, p:]
    assert torch.allclose(aligned_lp[resp_mask], to_response(lp_ref, p, r)[resp_mask], atol=1e-5)
    assert torch.allclose(aligned["batch"]["entropy"][:, p:][resp_mask], to_response(ent_ref, p, r)[resp_mask],
                          atol=1e-5)


def test_forward_the_vendor_way_temperature_and_optional_tensors(reference_server, tiny_model_dir):
    """As at the vendor: ``meta.temperature`` scales nothing without the ``apply_temperature`` post-processor,
    and a body without ``position_ids`` (rebuilt from the mask) and ``responses`` (``input_ids[:, P:]``)
    is served -- the vendor's verl client sends such bodies."""
    batch = make_batch(PROMPTS, RESPONSES)
    lp_ref, _ = direct_shifted(tiny_model_dir, batch, temperature=1.0)
    real = batch["response_mask"][:, 1:].bool()
    body = {"batch": {k: v for k, v in batch.items() if k not in ("position_ids", "responses")},
            "meta": {"temperature": 0.7}, "processing": {"post": ["compute_entropy_and_logprobs"]}}
    with job(reference_server, tiny_model_dir, "log_prob") as jid:
        out = forward(reference_server, jid, body)
    assert torch.allclose(out["batch"]["logprobs"][:, :-1][real], lp_ref[real], atol=1e-5)


class TestOneForwardBackwardPerMiniBatch:
    """One /forward-backward per mini-batch: the server splits it into GAS micro-batches (the vendor's
    contract), the gradient is that of the mini-batch's token mean whatever GAS is, and the metrics are
    the call's token means. ``meta.batch_num_tokens`` (the vendor's field) beats ``loss_scale_tokens``.

    The class's fixture runs every call once (lr 0: the weights never change, so every step sees the same
    gradient); each test checks one outcome."""

    @pytest.fixture(scope="class")
    def run(self, reference_server, tiny_model_dir) -> dict:
        # GRPO layout: each prompt sampled twice, rows of a group adjacent
        prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10]]
        responses = [[20, 21, 22], [23, 24], [25, 26, 27, 28], [29]]
        batch = rl_batch(prompts, responses)
        p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
        resp_mask = batch["response_mask"][:, p:].bool()
        out = {"batch": batch, "p": p, "resp_mask": resp_mask, "n_tokens": float(resp_mask.sum())}

        def one_step(jid, zorro=False, config=None, meta=None):
            body = grpo_body(batch, zorro=zorro, config=config)
            body["meta"].update(meta or {})
            metrics = decode(fwd_bwd(reference_server, jid, body))["metrics"]
            return metrics, decode(step(reference_server, jid))["metrics"]["grad_norm"]

        n_tokens = out["n_tokens"]
        with job(reference_server, tiny_model_dir, gas=2, lr=0.0) as jid:
            out["fwd_off"] = forward(reference_server, jid, grpo_body(batch))
            out["fwd_on"] = forward(reference_server, jid, grpo_body(batch, zorro=True))
            lp_off = to_response(out["fwd_off"]["batch"]["logprobs"], p, r)
            out["lp_off"], out["lp_on"] = lp_off, out["fwd_on"]["batch"]["logprobs"][:, -r:]  # ZoRRO: response-aligned
            batch["old_log_probs"] = torch.cat([torch.zeros(4, p), lp_off.detach()], dim=1)  # ratio 1
            out["off"] = one_step(jid)
            out["on"] = one_step(jid, zorro=True)
            out["scaled"] = one_step(jid, config={"loss_scale_tokens": 2 * n_tokens})
            out["meta"] = one_step(jid, config={"loss_scale_tokens": n_tokens}, meta={"batch_num_tokens": 2 * n_tokens})
            out["weighted"] = one_step(jid, meta={"rollout_is_weights": torch.full(batch["input_ids"].shape, 2.0)})
            out["zero"] = one_step(jid, meta={"rollout_is_weights": 0.0})
            in_batch = grpo_body({**batch, "rollout_is_weights": torch.ones(batch["input_ids"].shape)})
            out["refused"] = fwd_bwd(reference_server, jid, in_batch)
            out["info"] = requests.get(f"{reference_server.url}/job/{jid}", timeout=30).json()
        with job(reference_server, tiny_model_dir, gas=1, lr=0.0) as jid:
            out["gas1"] = one_step(jid)
        return out

    def test_zorro_forward_computes_fewer_tokens_with_the_same_log_probs(self, run):
        on, off = run["fwd_on"]["metrics"], run["fwd_off"]["metrics"]
        assert on["unique_prompts"] == 2 and on["tokens_computed"] < off["tokens_computed"]
        mask = run["resp_mask"]
        assert torch.allclose(run["lp_on"][mask], run["lp_off"][mask], atol=1e-5)

    def test_the_server_splits_the_call_into_gas_micro_batches(self, run):
        metrics, _ = run["off"]
        assert metrics["micro_batches"] == 2 and metrics["num_rows"] == 4 and metrics["num_tokens"] == run["n_tokens"]

    def test_pg_loss_is_the_calls_token_mean(self, run):
        metrics, _ = run["off"]
        advantages = run["batch"]["advantages"][:, run["p"]:][run["resp_mask"]]
        assert metrics["actor/pg_loss"] == pytest.approx(-float(advantages.sum()) / run["n_tokens"], abs=1e-5)
        assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-5)

    def test_gas_1_and_gas_2_give_the_same_loss_and_gradient(self, run):
        (m_off, g_off), (m_gas1, g_gas1) = run["off"], run["gas1"]
        assert m_off["actor/pg_loss"] == pytest.approx(m_gas1["actor/pg_loss"], abs=1e-5)
        assert g_off > 0 and g_gas1 == pytest.approx(g_off, rel=1e-4)  # micro-batches change nothing

    def test_zorro_gives_the_same_loss_and_gradient_with_fewer_tokens(self, run):
        (m_off, g_off), (m_on, g_on) = run["off"], run["on"]
        assert m_on["loss"] == pytest.approx(m_off["loss"], abs=1e-5)
        assert m_on["actor/pg_loss"] == pytest.approx(m_off["actor/pg_loss"], abs=1e-5)
        assert m_on["tokens_computed"] < m_off["tokens_computed"]
        assert g_off > 0 and g_on == pytest.approx(g_off, rel=1e-4)

    def test_loss_scale_tokens_divides_the_summed_loss(self, run):
        assert run["scaled"][1] == pytest.approx(run["off"][1] / 2, rel=1e-4)  # sum / (2N): half the gradient

    def test_meta_batch_num_tokens_beats_loss_scale_tokens(self, run):
        assert run["meta"][1] == pytest.approx(run["off"][1] / 2, rel=1e-4)

    def test_meta_rollout_is_weights_multiply_the_token_losses(self, run):
        assert run["weighted"][1] == pytest.approx(2 * run["off"][1], rel=1e-4)
        m_zero, g_zero = run["zero"]
        assert m_zero["actor/pg_loss"] == 0.0 and not g_zero

    def test_rollout_is_weights_in_the_batch_are_refused(self, run):
        refused = run["refused"]
        assert refused.status_code == 400 and refused.json()["detail"]["field"] == "batch.rollout_is_weights"

    def test_every_call_was_stepped(self, run):
        assert run["info"]["global_step"] == 6 and run["info"]["pending_forward_backward"] == 0


def test_job_level_zorro_answers_response_aligned(reference_server, tiny_model_dir):
    batch = make_batch(PROMPTS, RESPONSES)
    zorro = {"zorro_train_enable": True, "use_liger": False}
    with job(reference_server, tiny_model_dir, "log_prob", ds_worker_config=zorro) as jid:
        out = forward(reference_server, jid, grpo_body(batch))
    assert out["logprob_alignment"] == "response" and out["batch"]["logprobs"].shape == batch["input_ids"].shape


def test_one_forward_backward_per_step_else_400(reference_server, tiny_model_dir):
    body = grpo_body(rl_batch(PROMPTS * 2, RESPONSES * 2))
    with job(reference_server, tiny_model_dir, gas=2) as jid:
        early = step(reference_server, jid)
        assert early.status_code == 400 and early.json()["detail"]["field"] == "ds_config.gradient_accumulation_steps"
        odd = fwd_bwd(reference_server, jid, grpo_body(rl_batch()))  # 3 rows do not split into 2 micro-batches
        assert odd.status_code == 400 and odd.json()["detail"]["field"] == "batch.input_ids"
        assert odd.json()["detail"]["received"] == 3
        assert decode(fwd_bwd(reference_server, jid, body))["metrics"]["micro_batches"] == 2
        second = fwd_bwd(reference_server, jid, body)
        assert second.status_code == 400 and "/step" in second.json()["detail"]["message"]
        assert decode(step(reference_server, jid))["metrics"]["global_step"] == 1
        assert step(reference_server, jid).status_code == 400


def test_request_ids_replay_without_reapplying(reference_server, tiny_model_dir):
    body = grpo_body(rl_batch())
    other = grpo_body(rl_batch(seed=1))
    config = {"model_name": str(tiny_model_dir), "job_type": "training",
              "ds_config": {"gradient_accumulation_steps": 1}}
    url, once = reference_server.url + "/initialize", {"X-Request-Id": "init-1"}
    init_a = requests.post(url, json=config, headers=once, timeout=300)
    init_b = requests.post(url, json=config, headers=once, timeout=300)
    assert init_a.status_code == init_b.status_code == 200 and init_a.json() == init_b.json()
    assert init_b.headers.get("X-Idempotent-Replay") == "true"
    jid = init_a.json()["job_id"]
    try:
        first = fwd_bwd(reference_server, jid, body, headers={"X-Request-Id": "fb-1"})
        replay = fwd_bwd(reference_server, jid, body, headers={"X-Request-Id": "fb-1"})
        assert replay.content == first.content and replay.headers.get("X-Idempotent-Replay") == "true"
        conflict = fwd_bwd(reference_server, jid, other, headers={"X-Request-Id": "fb-1"})
        assert conflict.status_code == 409 and conflict.json()["detail"]["field"] == "X-Request-Id"
        assert requests.get(f"{reference_server.url}/job/{jid}").json()["pending_forward_backward"] == 1  # applied once
        s1 = decode(step(reference_server, jid, headers={"X-Request-Id": "st-1"}))
        s1_again = decode(step(reference_server, jid, headers={"X-Request-Id": "st-1"}))
        assert s1 == s1_again and s1["metrics"]["global_step"] == 1
        info = requests.get(f"{reference_server.url}/job/{jid}").json()
        assert info["global_step"] == 1 and info["pending_forward_backward"] == 0
    finally:
        requests.post(f"{reference_server.url}/destroy?job_id={jid}", json={"job_type": "training"}, timeout=60)


def test_entropy_is_computed_only_when_asked(reference_server, tiny_model_dir):
    """Clients send ``compute_entropy_and_logprobs`` on every call; ``meta.calculate_entropy`` decides."""
    batch = make_batch(PROMPTS, RESPONSES)
    post = {"post": ["apply_temperature", "compute_entropy_and_logprobs"]}
    with job(reference_server, tiny_model_dir, "training") as jid:
        without = grpo_body(batch, entropy=False)
        without["processing"].update(post)
        with_ = grpo_body(batch, entropy=True)
        with_["processing"].update(post)
        legacy = grpo_body(batch)
        legacy["processing"].update(post)
        del legacy["meta"]["calculate_entropy"]  # no flag: the post-processor names decide (vendor rule)
        got = {name: forward(reference_server, jid, body)["batch"] for name, body in
               (("without", without), ("with", with_), ("legacy", legacy))}
    assert "entropy" not in got["without"] and "entropy" in got["with"] and "entropy" in got["legacy"]
    torch.testing.assert_close(got["without"]["logprobs"], got["with"]["logprobs"])
