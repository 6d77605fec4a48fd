"""ArcticRLClient against the real reference server (``python -m arctic_rl.server`` subprocesses).

No mocks: a tiny Qwen3 is served by the reference server on CPU; batches are verl-shaped
(``tests.support.arctic``: verl's own ``left_right_2_no_padding``) with GRPO groups interleaved the way
verl's ``_balance_batch`` leaves them; log-probs are checked against the same model run locally
with ``transformers`` and read back with verl's own ``no_padding_2_padding``.

Each server test creates its own three jobs (the server allows one job per type), so tests destroy
before the next one creates; they are marked slow (every job creation starts DeepSpeed). The
launcher's failure paths run with stand-in executables and are fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from verl.utils import tensordict_utils as tu
from verl.utils.metric import reduce_metrics
from verl.utils.py_functional import rename_dict
from verl.workers.utils.padding import no_padding_2_padding

import verl.remote_backend.builtin  # noqa: F401  (registers the built-in backends)
from arctic_rl.protocol import GenerateResult
from tests.support.arctic import grpo_batch, hf_response_logprobs
from tests.support.reliability import MINI, N, client_config
from tests.support.server import running_server
from verl.remote_backend import RemoteBackendRegistry
from verl.remote_backend.errors import (
    RemoteConnectionError,
    RemoteJobNotFoundError,
    RemoteServerError,
    RemoteTimeoutError,
)
from verl.workers.remote_client.arctic.arctic_config import LocalServerConfig
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient
from verl.workers.remote_client.arctic.local_server import start_local_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("arctic_srv"), token="t0ken") as srv:
        yield srv


def main_config(model_dir, url: str | None, **arctic):
    """The tiny run of ``client_config`` with verl's KL loss on, and the shipped job seed and retry ceiling."""
    arctic.setdefault("train", {}).setdefault("seed", None)
    arctic.setdefault("retry", {}).setdefault("backoff_max_s", 30)
    return client_config(model_dir, url, run_dir="run1", kl_loss_coef=0.01, **arctic)


def train_inputs(client, data):
    """What verl's trainer adds before update_actor: old/ref log-probs, advantages, meta."""
    old = client.compute_log_prob(data)
    data["old_log_probs"] = no_padding_2_padding(old["log_probs"], data).float()
    ref = client.compute_ref_log_prob(data)
    data["ref_log_prob"] = no_padding_2_padding(ref["log_probs"], data).float()
    tu.assign_non_tensor(data, global_batch_size=MINI * N, mini_batch_size=MINI * N, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=True, temperature=1.0)
    return data


def server_jobs(srv) -> dict:
    return requests.get(srv.url + "/status", headers=srv.headers, timeout=10).json()["jobs"]


def policy_logprobs(client, data) -> torch.Tensor:
    """The training job's log-probs of ``data``, dense ``[B, R]``."""
    return no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data)


@pytest.mark.slow
class TestFullCycleV2:
    """One adapter (protocol v2) through a run's calls. Tests that need the initial weights come before the
    first update; the last test destroys the jobs."""

    @pytest.fixture(scope="class")
    def cfg(self, server, tiny_model_dir):
        return main_config(tiny_model_dir, server.url)

    @pytest.fixture(scope="class")
    def client(self, cfg):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ARCTIC_RL_TOKEN", "t0ken")
            client = RemoteBackendRegistry.create("arctic", cfg)
            yield client
            client.destroy()  # idempotent

    def test_the_backend_is_the_arctic_adapter_owning_three_jobs(self, client, server):
        assert isinstance(client, ArcticRLClient) and client.protocol == 2 and client.requires_single_forwarder()
        assert set(client.job_ids) == {"sampling", "log_prob", "training"} == set(client.owned_job_ids)
        # the server lists Features.BATCH_SHAPE: its DeepSpeed jobs were told verl's sizes (for their warm-up)
        shapes = {job["job_type"]: job["batch_shape"] for job in server_jobs(server).values()}
        expected = {"prompt_len": 16, "response_len": 8, "forward_rows": 4 * N, "forward_backward_rows": MINI * N}
        assert shapes == {"training": expected, "log_prob": expected, "sampling": None}

    def test_the_reconnect_handle_is_json_without_the_token(self, client, server):
        handle = json.loads(json.dumps(client.reconnect_handle()))
        assert handle["url"] == server.url and handle["protocol"] == 2 and handle["step"] == 0
        assert handle["instance_id"] and "t0ken" not in json.dumps(handle)

    def test_log_probs_and_entropy_match_transformers(self, client, tiny_model_dir):
        """Same values as the model run locally, in verl's nested layout and row order."""
        prompts, responses, data = grpo_batch()
        tu.assign_non_tensor(data, calculate_entropy=True)
        out = client.compute_log_prob(data)
        assert torch.equal(out["log_probs"].offsets(), data["input_ids"].offsets())
        assert out["entropy"].is_nested and set(tu.get(out, "metrics")) == {"mfu"}
        want = hf_response_logprobs(tiny_model_dir, prompts, responses)
        got = no_padding_2_padding(out["log_probs"], data)
        mask = data["response_mask"].bool()
        torch.testing.assert_close(got[mask], want[mask], atol=2e-4, rtol=1e-4)
        ent = no_padding_2_padding(out["entropy"], data)[mask]
        assert (ent > 0).all() and (ent <= torch.log(torch.tensor(float(110)))).all()

    def test_ref_log_probs_are_the_initial_policys(self, client, tiny_model_dir):
        """The log_prob job holds the initial weights."""
        prompts, responses, data = grpo_batch()
        ref = no_padding_2_padding(client.compute_ref_log_prob(data)["log_probs"], data)
        mask = data["response_mask"].bool()
        want = hf_response_logprobs(tiny_model_dir, prompts, responses)
        torch.testing.assert_close(ref[mask], want[mask], atol=2e-4, rtol=1e-4)

    def test_a_reattached_client_computes_the_same_and_owns_nothing(self, client, cfg, server):
        """Another process would attach the same way; destroying it leaves every job."""
        attached = ArcticRLClient.from_config(cfg, handle=json.loads(json.dumps(client.reconnect_handle())))
        assert attached.owned_job_ids == {} and attached.job_ids == client.job_ids
        _, _, data = grpo_batch()
        mask = data["response_mask"].bool()
        torch.testing.assert_close(policy_logprobs(attached, data)[mask], policy_logprobs(client, data)[mask])
        attached.destroy()
        assert len(server_jobs(server)) == 3

    def test_one_update_is_two_mini_batches_with_verls_metrics(self, client):
        """8 rows = 2 mini-batches of 4 rows, one /forward-backward each (2 micro-batches)."""
        _, _, data = grpo_batch()
        mask = data["response_mask"].bool()
        before, step = policy_logprobs(client, data), client.step
        metrics = tu.get(client.update_actor(train_inputs(client, data)), "metrics")
        for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss", "grad_norm", "lr",
                     "loss", "kl_loss", "mfu"):
            assert len(metrics[name]) == 2, name
        assert metrics["lr"] == [5e-3, 5e-3] and all(g > 0 for g in metrics["grad_norm"])
        logged = rename_dict(dict(metrics), "actor/")  # what verl's trainer does with the worker's metrics
        logged["perf/mfu/actor"] = logged.pop("actor/mfu")
        logged = reduce_metrics(logged)
        assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr", "actor/loss",
                "actor/kl_loss", "actor/entropy_loss", "perf/mfu/actor"} <= set(logged)
        assert metrics["loss"][0] != metrics["loss"][1]
        assert client.step == step + 2 and client.reconnect_handle()["step"] == step + 2
        assert (policy_logprobs(client, data)[mask] - before[mask]).abs().max() > 1e-3  # the weights moved

    def test_generate_after_a_weight_sync(self, client):
        """Token prompts, n=2 per prompt, answered in prompt order; unknown sampling keys are not sent."""
        sync = client.update_weights()
        assert sync["synced"] == [client.job_ids["sampling"]]
        results = client.generate([[5, 6, 7], [8, 9]], {"n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 3,
                                                         "not_a_protocol_knob": 1})
        assert len(results) == 4 and all(isinstance(r, GenerateResult) for r in results)
        assert [(r.prompt_index, r.sample_index) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [r.prompt_len for r in results] == [3, 3, 2, 2]
        assert all(1 <= len(r.token_ids) <= 4 for r in results)

    def test_generate_asks_this_server_for_the_compact_answer(self, client, monkeypatch):
        """The server lists ``compact_results``: the client asks for the sampled tokens' log-probs alone and no
        text (verl reads neither the candidates nor the text), whatever the caller passed for those keys."""
        from verl.workers.remote_client.arctic.dialect import DialectV2

        sent = []
        original = DialectV2.generate_payload

        def spy(self, prompts, sampling_params):
            sent.append(dict(sampling_params))
            return original(self, prompts, sampling_params)

        monkeypatch.setattr(DialectV2, "generate_payload", spy)
        results = client.generate([[5, 6, 7]], {"n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 5,
                                                "logprobs": 1, "ignore_eos": True, "logprobs_format": "candidates",
                                                "detokenize": True})
        assert sent and all(p["logprobs_format"] == "sampled" and p["detokenize"] is False for p in sent)
        assert all(r.text == "" and len(r.logprobs) == len(r.token_ids) == 4 for r in results)
        assert all(isinstance(x, float) and x <= 0 for r in results for x in r.logprobs)
        sent.clear()
        client.generate([[5, 6, 7]], {"max_tokens": 2})  # no log-probs asked: no log-prob shape sent
        assert sent and all("logprobs_format" not in p and p["detokenize"] is False for p in sent)

    def test_a_loaded_checkpoint_brings_back_its_log_probs(self, client, server):
        """Save, train on, load the saved step: the log-probs of the saved step again."""
        _, _, data = grpo_batch()
        mask = data["response_mask"].bool()
        step, at_save = client.step, policy_logprobs(client, data)
        saved = client.save_checkpoint()
        assert saved["global_step"] == step and saved["path"].endswith(f"checkpoint-{step}")
        assert server.checkpoint_root.resolve() in Path(saved["path"]).parents
        client.update_actor(train_inputs(client, data))
        assert client.step == step + 2
        assert (policy_logprobs(client, data)[mask] - at_save[mask]).abs().max() > 1e-4
        loaded = client.load_checkpoint(step=step)
        assert loaded["global_step"] == step and client.step == step
        torch.testing.assert_close(policy_logprobs(client, data)[mask], at_save[mask])

    def test_destroy_removes_the_jobs_and_is_idempotent(self, client, cfg, server):
        """Last in the class. A client attached before the destroy finds its jobs gone."""
        attached = ArcticRLClient.from_config(cfg, handle=client.reconnect_handle())
        try:
            client.destroy()
            assert server_jobs(server) == {}
            client.destroy()
            with pytest.raises(RemoteJobNotFoundError):
                attached.compute_log_prob(grpo_batch()[2])
        finally:
            attached.destroy()  # its watcher thread must not outlive the test (later tests restart the server)


@pytest.mark.slow
def test_full_determinism_samples_copies_of_a_prompt_apart_and_repeats_across_runs(server, tiny_model_dir,
                                                                                   monkeypatch):
    """Under rollout.full_determinism the adapter derives the seeds; copies of a prompt in one call (verl's n
    samples, batched by the rollout server) go in separate calls with their own seeds, and a second run with
    the same rollout.seed samples the same tokens in the same order."""
    monkeypatch.setenv("ARCTIC_RL_TOKEN", "t0ken")
    cfg = main_config(tiny_model_dir, server.url)
    cfg.actor_rollout_ref.rollout.full_determinism = True
    cfg.actor_rollout_ref.rollout.seed = 5
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [5, 6, 7]]
    params = {"n": 2, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    runs = []
    for _ in range(2):
        client = RemoteBackendRegistry.create("arctic", cfg)
        try:
            runs.append([client.generate(prompts, params), client.generate(prompts, params)])
        finally:
            client.destroy()
    first = runs[0][0]
    assert [(r.prompt_index, r.sample_index) for r in first] == [(p, s) for p in range(4) for s in range(2)]
    assert [r.prompt_len for r in first] == [3, 3, 2, 2, 3, 3, 3, 3]
    assert [[r.token_ids for r in call] for call in runs[0]] == [[r.token_ids for r in call] for call in runs[1]]
    copies = [tuple(r.token_ids) for r in first if r.prompt_len == 3]
    assert len(set(copies)) >= 5  # six samples of one prompt
    assert [r.token_ids for r in runs[0][0]] != [r.token_ids for r in runs[0][1]]  # a second call samples anew


@pytest.mark.slow
def test_destroy_touches_only_own_jobs_and_restart_is_detected(server, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("ARCTIC_RL_TOKEN", "t0ken")
    # the server rejects the training job (created last): the two jobs made before it are cleaned up
    bad = main_config(tiny_model_dir, server.url, train={"deepspeed": {"extra": {"optimizer": {"type": "Lamb"}}}})
    with pytest.raises(RemoteServerError) as err:
        ArcticRLClient.from_config(bad)
    assert err.value.status == 400 and "ds_config.optimizer.type" in str(err.value) and "Lamb" in str(err.value)
    assert server_jobs(server) == {}

    cfg = main_config(tiny_model_dir, server.url)
    first = ArcticRLClient.from_config(cfg)
    first_ids = first.job_ids
    first.destroy()
    second = ArcticRLClient.from_config(cfg)  # new jobs (the server allows one per type)
    try:
        assert set(second.job_ids.values()).isdisjoint(first_ids.values())
        first.destroy()  # already destroyed: sends nothing, the second client's jobs survive
        assert sorted(int(k) for k in server_jobs(server)) == sorted(second.job_ids.values())
        with pytest.raises(RemoteServerError) as err:  # a third creator is refused, not allowed to clean up
            ArcticRLClient.from_config(cfg)
        assert err.value.status == 409 and "never destroys jobs that may be in use" in str(err.value)
        assert sorted(int(k) for k in server_jobs(server)) == sorted(second.job_ids.values())
        handle = second.reconnect_handle()
        server.restart()  # kill -9: jobs and their state are gone
        with pytest.raises(RemoteJobNotFoundError, match="restarted"):
            ArcticRLClient.from_config(cfg, handle=handle)
    finally:
        second.destroy()  # the jobs are gone with the old process: 404s are fine


_CHILD_DRIVER = """
import json, sys, time
from omegaconf import OmegaConf
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient
client = ArcticRLClient.from_config(OmegaConf.load(sys.argv[1]))
print(json.dumps(client.job_ids), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_jobs_of_a_sigkilled_driver_are_reclaimed_only_when_abandoned(server, tiny_model_dir, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setenv("ARCTIC_RL_TOKEN", "t0ken")
    cfg = main_config(tiny_model_dir, server.url)
    (tmp_path / "cfg.yaml").write_text(OmegaConf.to_yaml(cfg))
    child = subprocess.Popen([sys.executable, "-c", _CHILD_DRIVER, str(tmp_path / "cfg.yaml")],
                             stdout=subprocess.PIPE, text=True)
    try:
        abandoned = json.loads(child.stdout.readline())
    finally:
        child.kill()  # no atexit hook, no destroy: its three jobs stay on the server
        child.wait(timeout=60)
    assert sorted(int(k) for k in server_jobs(server)) == sorted(abandoned.values())

    with pytest.raises(RemoteServerError) as err:  # not opted in: refused, with the way out named
        ArcticRLClient.from_config(cfg)
    assert err.value.status == 409 and "remote_backend.server.reclaim_idle_jobs_s" in str(err.value)
    with pytest.raises(RemoteServerError) as err:  # opted in, but the jobs have not been idle that long
        ArcticRLClient.from_config(main_config(tiny_model_dir, server.url, server={"reclaim_idle_jobs_s": 3600}))
    assert err.value.status == 409 and "not an abandoned job" in str(err.value)
    assert sorted(int(k) for k in server_jobs(server)) == sorted(abandoned.values())

    time.sleep(1.5)
    reclaim = main_config(tiny_model_dir, server.url, server={"reclaim_idle_jobs_s": 1})
    client = ArcticRLClient.from_config(reclaim)
    try:
        assert set(client.job_ids.values()).isdisjoint(abandoned.values())
        assert sorted(int(k) for k in server_jobs(server)) == sorted(client.job_ids.values())
        assert all(v["idle_s"] >= 0 and v["client_tag"] == client.client_tag for v in server_jobs(server).values())
    finally:
        client.destroy()

    # a job without a client tag (another client's, e.g. the vendor's) is never reclaimed
    body = {"model_name": str(tiny_model_dir), "job_type": "sampling", "checkpoint_path": "untagged"}
    foreign = requests.post(server.url + "/initialize", json=body, headers=server.headers, timeout=300).json()["job_id"]
    try:
        time.sleep(1.5)
        with pytest.raises(RemoteServerError) as err:
            ArcticRLClient.from_config(reclaim)
        assert err.value.status == 409
        assert list(server_jobs(server)) == [str(foreign)]
    finally:
        requests.post(server.url + f"/destroy?job_id={foreign}", json={"job_type": "sampling"}, headers=server.headers,
                      timeout=60)
    assert server_jobs(server) == {}


@pytest.mark.slow
def test_local_server_v1_and_zorro(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("ARCTIC_RL_TOKEN", raising=False)
    root = {"checkpoint_root": str(tmp_path / "srv")}
    cfg = main_config(tiny_model_dir, None, server={"protocol": "v1", "local": root},
                      train={"zorro_train": {"enable": True}})
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = False  # the reference server's ZoRRO needs it off
    client = ArcticRLClient.from_config(cfg)
    local = client._local
    try:
        assert local is not None and local.alive and client.protocol == 1
        assert client.reconnect_handle()["url"] == local.url and local.url.startswith("http://127.0.0.1:")
        assert local.log_path.is_file() and local.log_path.parent == (tmp_path / "srv").resolve()
        prompts, responses, data = grpo_batch(seed=4)
        tu.assign_non_tensor(data, calculate_entropy=True)
        got = no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data)  # ZoRRO: response-aligned
        mask = data["response_mask"].bool()
        torch.testing.assert_close(got[mask], hf_response_logprobs(tiny_model_dir, prompts, responses)[mask], atol=2e-4,
                                   rtol=1e-4)
        data = train_inputs(client, data)
        metrics = tu.get(client.update_actor(data), "metrics")
        # micro-batches are whole GRPO groups (2 rows of one prompt): ZoRRO runs the prompt (width 7) once
        # and both responses (width 8): 7 + 2 * 8 = 23 tokens per call instead of 2 * 15, two calls per step
        assert metrics["arctic/tokens_computed"] == [46.0, 46.0]
        assert len(metrics["actor/pg_loss"]) == 2 and client.step == 2
        after = no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data)
        assert (after[mask] - got[mask]).abs().max() > 1e-3
        assert client.update_weights()  # v1 /sync-weights
        assert len(client.generate([[5, 6, 7]], {"max_tokens": 3})) == 1  # v1 JSON /generate
        assert "path" in client.save_checkpoint()  # v1 /save-checkpoint
        assert os.path.isdir(tmp_path / "srv" / "training")
    finally:
        client.destroy()
    assert not local.alive
    client.destroy()


def _fake_python(tmp_path, body: str):
    script = tmp_path / "fake_python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


def test_local_server_that_dies_is_reported_with_its_log(tmp_path):
    python = _fake_python(tmp_path, 'echo "fake server: cannot load model $@"; exit 3')
    cfg = LocalServerConfig(checkpoint_root=str(tmp_path / "root"), startup_timeout_s=30)
    with pytest.raises(RemoteConnectionError) as err:
        start_local_server(cfg, python=python)
    text = str(err.value)
    assert "exited with code 3" in text and "cannot load model -m arctic_rl.server --host 127.0.0.1" in text
    assert "--checkpoint-root" in text and "--device cpu --sampler auto --threads 1" in text


def test_local_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    python = _fake_python(tmp_path, f'echo $$ > {pid_file}; echo "fake server: warming up"; exec sleep 60')
    cfg = LocalServerConfig(checkpoint_root=str(tmp_path / "root"), startup_timeout_s=1.0)
    with pytest.raises(RemoteTimeoutError) as err:
        start_local_server(cfg, python=python)
    assert err.value.timeout_s == 1.0 and "warming up" in str(err.value)
    with pytest.raises(ProcessLookupError):  # terminated and reaped, not leaked
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.slow  # a driver process that imports verl, and a real server
def test_local_server_outlives_no_sigkilled_driver(tmp_path):
    """A driver killed with SIGKILL runs no atexit hook; its private server must still go away."""
    info = tmp_path / "server.json"
    driver = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, time\n"
        "from verl.workers.remote_client.arctic.arctic_config import LocalServerConfig\n"
        "from verl.workers.remote_client.arctic.local_server import start_local_server\n"
        f"s = start_local_server(LocalServerConfig(checkpoint_root={str(tmp_path / 'root')!r}, startup_timeout_s=240))\n"
        f"open({str(info)!r}, 'w').write(json.dumps({{'pid': s.proc.pid, 'url': s.url}}))\n"
        "time.sleep(600)\n")], cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 300
        while not info.exists() or not info.read_text():
            assert driver.poll() is None and time.monotonic() < deadline, "the driver did not start a server"
            time.sleep(0.5)
        server = json.loads(info.read_text())
        assert requests.get(server["url"] + "/health", timeout=10).ok
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                os.kill(server["pid"], 0)
            except ProcessLookupError:
                break
            if _is_zombie(server["pid"]):
                break
            assert time.monotonic() < deadline, "the local server survived its SIGKILLed driver"
            time.sleep(0.5)
    finally:
        if driver.poll() is None:
            driver.kill()
        if info.exists() and info.read_text():
            try:
                os.kill(json.loads(info.read_text())["pid"], 9)
            except ProcessLookupError:
                pass


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False
