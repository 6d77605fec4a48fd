"""The reference server runs its sampling and training jobs at once (feature ``concurrent_jobs``).

Against a real server process (tiny Qwen3, CPU, one torch thread):

* ``/health`` lists ``concurrent_jobs``;
* a ``/generate`` sent while a long ``/forward-backward`` of the training job runs is answered while that call
  still runs, in about the time it takes alone (timed overlap, not serialised behind the training call);
* one answer never mixes weight versions: a ``/weight-sync`` sent while a multi-prompt ``/generate`` runs
  restarts that call on the new weights (``--in-flight-on-weight-load restart``, the default) unless it ended
  first; each answer's results carry one ``weight_version``, the call sent after the sync the new one.

This is what the asynchronous remote trainer mode (``trainer.v1.remote_backend.async_mode``) relies on.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests
import torch

from tests.support.server import decode, make_batch, post_frame

pytestmark = pytest.mark.slow

SHORT = [[5, 6, 7]]


@pytest.fixture(scope="module")
def jobs(reference_server, tiny_model_dir):
    """A training job and a sampling job on the module's server."""
    url = reference_server.url
    training = decode(requests.post(url + "/initialize", timeout=300, json={
        "model_name": str(tiny_model_dir), "job_type": "training", "checkpoint_path": "train",
        "ds_config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0}}))
    sampling = decode(requests.post(url + "/initialize", timeout=300,
                                    json={"model_name": str(tiny_model_dir), "job_type": "sampling"}))
    ids = {"training": training["job_id"], "sampling": sampling["job_id"]}
    yield reference_server, ids
    for job_type, job_id in ids.items():
        requests.post(f"{url}/destroy?job_id={job_id}", json={"job_type": job_type}, timeout=60)


def generate(srv, job_id, prompts, **params) -> dict:
    return decode(post_frame(srv, f"/generate?job_id={job_id}", {"prompts": prompts, "sampling_params": params}))


def long_training_body(rows: int, length: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40, (length // 2,), generator=gen).tolist() for _ in range(rows)]
    responses = [torch.randint(5, 40, (length // 2,), generator=gen).tolist() for _ in range(rows)]
    batch = make_batch(prompts, responses)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=gen) * batch["response_mask"]
    batch["old_log_probs"] = torch.zeros(batch["input_ids"].shape)
    return {"batch": batch, "meta": {}, "processing": {"loss_fn": "grpo", "config": {}}}


def busy(srv, job_id) -> bool:
    return bool(requests.get(f"{srv.url}/job/{job_id}", timeout=30).json().get("busy"))


def test_health_lists_concurrent_jobs(jobs):
    srv, _ = jobs
    assert "concurrent_jobs" in requests.get(srv.url + "/health", timeout=30).json()["features"]


def test_generate_is_answered_while_a_forward_backward_runs(jobs):
    srv, ids = jobs
    params = {"temperature": 1.0, "max_tokens": 4, "ignore_eos": True, "seed": 1}
    generate(srv, ids["sampling"], SHORT, **params)  # warm
    t0 = time.monotonic()
    generate(srv, ids["sampling"], SHORT, **params)
    alone_s = time.monotonic() - t0

    body = long_training_body(rows=48, length=384)
    times: dict[str, float] = {}

    def train() -> None:
        times["fb_start"] = time.monotonic()
        times["fb_status"] = post_frame(srv, f"/forward-backward?job_id={ids['training']}", body).status_code
        times["fb_end"] = time.monotonic()

    thread = threading.Thread(target=train)
    thread.start()
    while not busy(srv, ids["training"]):
        assert thread.is_alive(), times
        time.sleep(0.01)
    time.sleep(0.2)  # well inside the training call
    g0 = time.monotonic()
    answer = generate(srv, ids["sampling"], SHORT, **params)
    g1 = time.monotonic()
    training_still_running = thread.is_alive()
    thread.join(timeout=600)
    requests.post(f"{srv.url}/step?job_id={ids['training']}", json={}, timeout=120)
    fb_s = times["fb_end"] - times["fb_start"]
    print(f"generate alone {alone_s:.3f} s, during forward-backward {g1 - g0:.3f} s; forward-backward {fb_s:.2f} s")
    assert times["fb_status"] == 200
    assert answer["results"][0]["generation_len"] == 4
    assert training_still_running, f"the forward-backward ({fb_s:.2f} s) ended before the generate was answered"
    assert g1 < times["fb_end"]
    assert g1 - g0 < 0.5 * fb_s, (g1 - g0, fb_s)  # not serialised behind the training call


def test_one_answer_never_mixes_weight_versions(jobs):
    srv, ids = jobs
    answers: list[dict] = []
    params = {"temperature": 1.0, "max_tokens": 192, "ignore_eos": True, "seed": 2, "n": 4}
    first = threading.Thread(target=lambda: answers.append(generate(srv, ids["sampling"], [[5, 6], [7, 8, 9]],
                                                                    **params)))
    first.start()
    while not busy(srv, ids["sampling"]):
        assert first.is_alive(), "the generate ended before the weight sync could be sent during it"
        time.sleep(0.002)
    sync = requests.post(f"{srv.url}/weight-sync?job_id={ids['training']}", timeout=300,
                         json={"source_sub_job_id": ids["training"], "target_sub_job_ids": [ids["sampling"]]})
    first.join(timeout=300)
    assert answers, "the first generate failed"
    second = generate(srv, ids["sampling"], [[5, 6], [7, 8, 9]], **params)
    assert sync.status_code == 200, sync.text
    synced_version = sync.json()["weight_version"]
    for answer in (answers[0], second):
        versions = {r["weight_version"] for r in answer["results"]}
        assert len(versions) == 1 and versions == {answer["weight_version"]}, versions
        assert all(r["generation_len"] == 192 for r in answer["results"])
    assert answers[0]["weight_version"] in (synced_version - 1, synced_version) and synced_version == second["weight_version"]
