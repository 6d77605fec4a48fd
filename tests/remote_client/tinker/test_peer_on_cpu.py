"""The Tinker adapter against a real Tinker API server (SkyRL's, on CPU) through the official SDK.

The peer is the session's ``tinker_peer`` (``tests/support/tinker.py``; ~30 s cold, ~10 s with a
warm JAX cache), shared with the Tinker end-to-end run. Every batch has 4 rows of <= 32 tokens and
every sample call the same ``max_tokens`` (``PEER_SHAPES``), so each XLA program of the peer
compiles once per session. Checks: sampling with per-token log-probs; reference log-probs equal the
peer's own ``compute_logprobs`` of the base model; old log-probs equal a sampler of the synced
weights; one update moves log-probs the way the advantages say; a second process's sampler
follows a weight sync; save/load round trip; destroy.
"""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf
from verl.utils import tensordict_utils as tu

from tests.support.tinker import PEER_API_KEY, PEER_SHAPES
from verl.remote_backend.errors import RemoteBackendConfigError

pytestmark = pytest.mark.slow

MAX_TOKENS = PEER_SHAPES["max_tokens"]


@pytest.fixture(scope="module")
def peer(tinker_peer):
    """The session's peer, with the SDK's API key set for this module only."""
    old = os.environ.get("TINKER_API_KEY")
    os.environ["TINKER_API_KEY"] = PEER_API_KEY
    try:
        yield tinker_peer.url, tinker_peer.model
    finally:
        if old is None:
            os.environ.pop("TINKER_API_KEY", None)
        else:
            os.environ["TINKER_API_KEY"] = old


def _main_config(url: str, model, ckpt_dir):
    from tests.support.arctic import _verl_base
    from tests.support.tinker import REPO

    tinker_yaml = OmegaConf.load(REPO / "verl/trainer/config/remote_backend/tinker.yaml")
    extra = {
        "remote_backend": {**OmegaConf.to_container(tinker_yaml), "server": {"url": url, "base_model": None}},
        "actor_rollout_ref": {
            "model": {"path": str(model), "lora_rank": PEER_SHAPES["lora_rank"]},
            "actor": {"ppo_mini_batch_size": 1, "use_kl_loss": False, "loss_agg_mode": "token-mean",
                      "optim": {"lr": 5e-2, "total_training_steps": 4, "lr_warmup_steps_ratio": 0.0}},
            "rollout": {"n": 4, "temperature": 1.0},
        },
        "trainer": {"default_local_dir": str(ckpt_dir)},
    }
    return OmegaConf.merge(_verl_base(), OmegaConf.create(extra))


@pytest.fixture(scope="module")
def setup(peer, tmp_path_factory):
    from transformers import AutoTokenizer

    from verl.remote_backend.base import RemoteBackendRegistry

    url, model = peer
    import verl.remote_backend.builtin  # noqa: F401

    main = _main_config(url, model, tmp_path_factory.mktemp("ckpt"))
    backend = RemoteBackendRegistry.create("tinker", main)
    tok = AutoTokenizer.from_pretrained(str(model))
    yield main, backend, tok
    backend.destroy()


def _rows(tok) -> tuple[list[int], list[list[int]]]:
    prompt = tok.encode("abcd=", add_special_tokens=False)
    responses = [tok.encode(s, add_special_tokens=False) for s in ("dcba", "dcb", "aaaa", "bbbab")]
    assert len(responses) == PEER_SHAPES["rows"]
    assert len(prompt) + max(map(len, responses)) <= PEER_SHAPES["max_seq_len"]
    return prompt, responses


def _batch(prompt, responses, *, old=None, adv=None):
    def nested(rows, dtype):
        return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)

    fields = {"input_ids": nested([prompt + r for r in responses], torch.int64),
              "prompts": nested([prompt] * len(responses), torch.int64),
              "responses": nested(responses, torch.int64),
              "response_mask": nested([[1.0] * len(r) for r in responses], torch.float32)}
    if old is not None:
        fields["old_log_probs"] = nested(old, torch.float32)
        fields["advantages"] = nested(adv, torch.float32)
    return tu.get_tensordict(fields, non_tensor_dict={"calculate_entropy": True, "global_batch_size": 4,
                                                      "epochs": 1})


def _response_lps(out, prompt, responses) -> list[list[float]]:
    values = out["log_probs"]
    p = len(prompt)
    return [row.tolist()[p - 1 : p - 1 + len(r)] for row, r in zip(values.unbind(), responses)]


def test_sampling_returns_n_samples_with_per_token_logprobs(setup):
    _, backend, tok = setup
    prompt, _ = _rows(tok)
    results = backend.generate([prompt] * 4, {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 0})
    assert len(results) == 4
    for r in results:
        assert 1 <= len(r["token_ids"]) <= MAX_TOKENS
        assert r["logprobs"] is not None and len(r["logprobs"]) == len(r["token_ids"])
        assert all(lp <= 0.0 for lp in r["logprobs"])
        assert r["finish_reason"] in ("stop", "length")


def test_ref_and_old_log_probs_equal_the_peers_compute_logprobs(setup):
    _, backend, tok = setup
    prompt, responses = _rows(tok)
    ref = _response_lps(backend.compute_ref_log_prob(_batch(prompt, responses)), prompt, responses)
    base = backend.session.sampling_client(base_model=backend.run.base_model)
    sync = backend.update_weights()
    synced = backend.session.sampling_client(model_path=sync["sampler_update"]["model_path"])
    out = backend.compute_log_prob(_batch(prompt, responses))
    old = _response_lps(out, prompt, responses)
    for r, ref_row, old_row in zip(responses, ref, old):
        seq = prompt + r
        peer_base = base.compute_logprobs(backend.session.model_input(seq)).result(120)
        peer_synced = synced.compute_logprobs(backend.session.model_input(seq)).result(120)
        want_base = [float(x) for x in list(peer_base)[-len(r):]]
        want_synced = [float(x) for x in list(peer_synced)[-len(r):]]
        assert ref_row == pytest.approx(want_base, abs=1e-4)
        assert old_row == pytest.approx(want_synced, abs=1e-3)
    entropy = out["entropy"].values()
    assert torch.allclose(entropy, -out["log_probs"].values())  # the one-sample estimate


def test_one_update_moves_log_probs_the_way_the_advantages_say(setup):
    _, backend, tok = setup
    prompt, responses = _rows(tok)
    before = _response_lps(backend.compute_log_prob(_batch(prompt, responses)), prompt, responses)
    adv = [[1.0] * len(r) if i < 2 else [-1.0] * len(r) for i, r in enumerate(responses)]
    step_before = backend.step
    out = backend.update_actor(_batch(prompt, responses, old=before, adv=adv))
    metrics = tu.get(out, "metrics")
    assert set(metrics) >= {"pg_loss", "ppo_kl", "pg_clipfrac", "lr", "mfu"} and len(metrics["lr"]) == 1
    assert backend.step == step_before + 1
    after = _response_lps(backend.compute_log_prob(_batch(prompt, responses)), prompt, responses)
    mean = [sum(a) / len(a) - sum(b) / len(b) for a, b in zip(after, before)]
    assert mean[0] > 0 and mean[1] > 0, mean
    assert mean[2] < 0 and mean[3] < 0, mean


def test_a_second_processes_sampler_follows_the_weight_sync(setup):
    from verl.remote_backend.base import RemoteBackendRegistry

    main, backend, tok = setup
    prompt, _ = _rows(tok)
    rollout_side = RemoteBackendRegistry.create("tinker", main, handle=backend.reconnect_handle())
    try:
        sync = backend.update_weights()
        rollout_side.adopt_sampler(sync["sampler_update"])
        results = rollout_side.generate([prompt] * 4, {"max_tokens": MAX_TOKENS, "seed": 1})
        responses = [r["token_ids"] for r in results if r["token_ids"]]
        while len(responses) < 4:
            responses.append(responses[0])
        trained = _response_lps(backend.compute_log_prob(_batch(prompt, responses)), prompt, responses)
        for r, row in zip(results, trained):
            assert r["logprobs"] == pytest.approx(row[: len(r["logprobs"])], abs=1e-3)
    finally:
        rollout_side.destroy()


def test_save_and_load_state_round_trip_and_resume_index(setup):
    _, backend, tok = setup
    prompt, responses = _rows(tok)
    saved = backend.save_checkpoint(step=7)
    assert saved["path"].startswith("tinker://")
    at_save = _response_lps(backend.compute_log_prob(_batch(prompt, responses)), prompt, responses)
    adv = [[1.0] * len(r) if i % 2 else [-1.0] * len(r) for i, r in enumerate(responses)]
    backend.update_actor(_batch(prompt, responses, old=at_save, adv=adv))
    moved = _response_lps(backend.compute_log_prob(_batch(prompt, responses)), prompt, responses)
    assert moved != at_save
    loaded = backend.load_checkpoint(step=7)
    assert loaded["path"] == saved["path"] and backend.step == 7
    back = _response_lps(backend.compute_log_prob(_batch(prompt, responses)), prompt, responses)
    for a, b in zip(back, at_save):
        assert a == pytest.approx(b, abs=1e-5)
    with pytest.raises(RemoteBackendConfigError, match="global step 8"):
        backend.load_checkpoint(step=8)


def test_destroy_is_idempotent_and_later_calls_fail_clearly(setup):
    main, backend, tok = setup
    from verl.remote_backend.base import RemoteBackendRegistry

    other = RemoteBackendRegistry.create("tinker", main, handle=backend.reconnect_handle())
    prompt, responses = _rows(tok)
    other.compute_ref_log_prob(_batch(prompt, responses))
    other.destroy()
    other.destroy()
    with pytest.raises(RemoteBackendConfigError, match="destroyed"):
        other.compute_log_prob(_batch(prompt, responses))
