"""The vendor's own verl client (Arctic-Platform ``integrations/verl/``, unmodified snapshot) driving OUR
reference server through a two-step GRPO-like sequence.

``vendor_client_driver.py`` runs in its own process (the vendor's wrapper registers the ``"arctic"``
backend name that ours registers too): it creates the jobs with the vendor's client, then its
``ArcticRLClientWrapper`` generates, computes old/reference log-probs (``/forward`` without
``position_ids`` or ``responses``), updates the actor (one ``/forward-backward`` per mini-batch with
``gradient_accumulation_steps`` 4, then ``/step``), sleeps and wakes the sampler, syncs weights
through ``/operation`` (then resets the prefix cache through it), and calls ``/log-probs``,
``/sleep-training``, ``/wake-training``, ``/save`` and ``/destroy``. The test checks each phase's answer
and, through our server's own routes, what it did (step count, weight norms after the sync, the
prefix-cache reset, no jobs left). Our server's remaining vendor routes and their 4xx answers are
checked directly at the end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.support.server import decode

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).resolve().parent / "vendor_client_driver.py"


def run_driver(server, model_dir: Path, vendor_src: Path, workdir: Path) -> dict[str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(DRIVER), "--url", server.url, "--model", str(model_dir),
                           "--workdir", str(workdir), "--vendor-src", str(vendor_src)],
                          capture_output=True, text=True, timeout=900, env=env, check=False)
    phases: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            phases.setdefault(row.pop("phase"), []).append(row)
    assert proc.returncode == 0, f"the vendor's client failed (phases done: {list(phases)}):\n{proc.stderr[-6000:]}"
    return phases


def test_vendor_verl_client_runs_grpo_steps_on_our_server(reference_server, tiny_model_dir, vendor_src, tmp_path):
    phases = run_driver(reference_server, tiny_model_dir, vendor_src, tmp_path)
    jobs = phases["initialize"][0]["jobs"]
    assert set(jobs) == {"training", "sampling", "log_prob"} and all(isinstance(v, int) for v in jobs.values())

    # generate answers the vendor's per-token {token_id: {logprob, rank}} (logprobs=0: the sampled token only)
    for gen in phases["generate"]:
        entry = gen["logprobs_entry"]
        assert gen["rows"] == 8 and isinstance(entry, dict) and len(entry) == 1
        assert set(next(iter(entry.values()))) == {"logprob", "rank"}

    # /forward without position_ids/responses; the log_prob job holds the initial weights, so at step 0
    # the two agree and after an update (step 1) they differ
    fwd = phases["forward"]
    assert fwd[0]["shape"] == fwd[0]["ref_shape"] and fwd[0]["max_diff_ref"] < 1e-5
    assert fwd[1]["max_diff_ref"] > 1e-4

    # one /forward-backward per mini-batch then /step: two mini-batches per step, an optimizer step each
    # (our loss names its metrics as the vendor's does -- actor/pg_loss, ... -- and the wrapper passes them on)
    for upd in phases["update_actor"]:
        m = upd["metrics"]
        pg_loss = m.get("actor/pg_loss")
        assert isinstance(pg_loss, float) and math.isfinite(pg_loss) and math.isfinite(upd["loss"]), m
        assert m["grad_norm"] > 0, m  # gradients flowed
    # the weight sync ran through /operation and landed: /weight-norm of trainer and sampler agree
    for ws in phases["update_weights"]:
        assert ws["out"].get("synced") == [jobs["sampling"]] or ws["out"].get("job_id") == jobs["training"], ws
    assert phases["sleep_inference"][0]["out"]["sampling"]["status"] == "sleeping"
    assert phases["log_probs"][0]["out"]["results_shape"][0] == 1
    assert phases["sleep_training"][0]["out"]["workers"][0]["mode"] == "all"
    assert phases["wake_training"][0]["out"]["job_id"] == jobs["training"]
    saved = phases["save"][0]["out"]
    assert saved["global_step"] == 4 and saved["path"], saved  # 2 GRPO steps x 2 mini-batches
    assert requests.get(reference_server.url + "/status", timeout=10).json()["jobs"] == {}


class TestVendorControlRoutes:
    """The routes the vendor's client does not reach in a run: /weight-norm, /empty-training-cache,
    /sleep-log-prob, /wake-log-prob, /reset-prefix-cache, /wake-inference; and their 404/400 answers.
    One job of each type for the class, destroyed at its end."""

    @pytest.fixture(scope="class")
    def jobs(self, reference_server, tiny_model_dir) -> dict[str, int]:
        url = reference_server.url

        def init(job_type: str, **extra) -> int:
            body = {"model_name": str(tiny_model_dir), "job_type": job_type, **extra}
            return decode(requests.post(url + "/initialize", json=body, timeout=300))["job_id"]

        made: dict[str, int] = {}
        try:
            made["sampling"] = init("sampling")
            made["log_prob"] = init("log_prob")
            made["training"] = init("training", checkpoint_path="t",
                                    ds_config={"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1})
            yield made
        finally:
            for job_id in made.values():
                requests.post(f"{url}/destroy?job_id={job_id}", timeout=120)

    def test_weight_norm_of_the_training_job_equals_the_samplers(self, reference_server, jobs):
        norms = requests.post(reference_server.url + "/weight-norm", timeout=60,
                              json={"training_job_id": jobs["training"], "sampling_job_id": jobs["sampling"]}).json()
        assert norms["training_norm"] == pytest.approx(norms["sampling_norm"], rel=1e-6)
        assert norms["training_num_params"] == norms["sampling_num_params"] > 0

    def test_empty_training_cache_reports_each_workers_memory(self, reference_server, jobs):
        url = f"{reference_server.url}/empty-training-cache?job_id={jobs['training']}"
        assert "gpu_mb" in requests.post(url, timeout=60).json()["workers"][0]

    def test_the_log_prob_job_sleeps_and_wakes(self, reference_server, jobs):
        url, log_prob = reference_server.url, jobs["log_prob"]
        assert requests.post(f"{url}/sleep-log-prob?job_id={log_prob}", timeout=60).json()["job_id"] == log_prob
        assert requests.post(f"{url}/wake-log-prob?job_id={log_prob}", timeout=60).json()["job_id"] == log_prob

    def test_reset_prefix_cache_counts_the_reset(self, reference_server, jobs):
        url = f"{reference_server.url}/reset-prefix-cache?job_id={jobs['sampling']}"
        assert requests.post(url, json={}, timeout=60).json()["sampling"]["prefix_cache_resets"] >= 1

    def test_wake_inference_of_the_weights(self, reference_server, jobs):
        url = f"{reference_server.url}/wake-inference?job_id={jobs['sampling']}"
        wake = requests.post(url, json={"tags": ["weights"]}, timeout=60).json()
        assert wake["sampling"]["status"] in ("awake", "partly_awake")

    @pytest.mark.parametrize("route, job, body, status, field", [
        ("/operation", "sampling", {"operation_type": "explode"}, 400, "operation_type"),
        ("/sleep-inference", "training", {"level": 1}, 400, "job_id"),
        ("/sleep-inference", None, {"level": 1}, 404, "job_id"),
        ("/sleep-training", "training", {"mode": "deep"}, 400, "mode"),
        ("/wake-inference", "sampling", {"tags": ["brain"]}, 400, "tags"),
        ("/log-probs", "log_prob", {"prompts": ["a"], "completions": ["b", "c"]}, 400, "completions"),
    ], ids=["unknown-operation", "sleep-a-trainer", "sleep-no-job", "unknown-sleep-mode", "unknown-wake-tag",
            "completions-not-per-prompt"])
    def test_bad_requests_name_the_field(self, reference_server, jobs, route, job, body, status, field):
        job_id = jobs[job] if job else 999
        resp = requests.post(f"{reference_server.url}{route}?job_id={job_id}", json=body, timeout=60)
        assert resp.status_code == status, resp.text
        assert resp.json()["detail"]["field"] == field, resp.text
