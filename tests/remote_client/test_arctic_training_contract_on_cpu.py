"""The training contract of the vendor's Arctic server, held by our adapter against our reference server.

The same facts as ``tests/conformance/test_vendor_training_on_cpu.py`` (which checks them against the
vendor's own server), here against ``python -m arctic_rl.server`` with the adapter's default
``remote_backend`` config:

* ``update_actor`` with gradient accumulation 1, 2 and 4: one ``/forward-backward`` per mini-batch and
  one ``/step``; the server's ``global_step`` (``GET /job``, ``/save``) equals the adapter's step count,
  nothing is left pending;
* the reported metrics are each mini-batch's token means: equal for GAS 1, 2 and 4 (summing the
  micro-batches would double or quadruple them);
* the update runs at the sampling temperature (ratio 1 for unchanged weights: ``actor/ppo_kl`` 0);
* ``rollout_is_weights`` take effect (x2 doubles ``actor/pg_loss``, 0 zeroes it).

The learning rate is 0, so every call sees the same weights and the runs are comparable.
"""

from __future__ import annotations

import pytest
import requests
from _helpers_arctic import update_batch, verl_main_config
from verl.utils import tensordict_utils as tu

from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

pytestmark = pytest.mark.slow

N = 2  # rollout.n
MINI = 2  # ppo_mini_batch_size (prompts): 4 rows per mini-batch, 2 mini-batches per update
TEMPERATURE = 0.7
#: metrics of GAS 1, 2 and 4 (filled by the GAS 1 run)
_GAS1: dict[str, list[float]] = {}


def main_config(model_dir, url: str, *, micro: int):
    """Everything under ``remote_backend`` at its default except the server URL."""
    return verl_main_config({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 8},
        "trainer": {"default_local_dir": "contract_run"},
        "actor_rollout_ref": {
            "rollout": {"n": N, "temperature": TEMPERATURE},
            "actor": {"ppo_mini_batch_size": MINI, "ppo_micro_batch_size_per_gpu": micro, "ppo_epochs": 1,
                      "optim": {"lr": 0.0}, "shuffle": False},
        },
        "remote_backend": {"server": {"url": url}, "retry": {"backoff_initial_s": 0.05}},
    }, model_path=str(model_dir))


def train_data(client: ArcticRLClient, weights: float | None = None):
    """8 rows (4 prompts x n=2) as verl hands them to update_actor (two mini-batches)."""
    return update_batch(client, temperature=TEMPERATURE, mini_rows=MINI * N, weights=weights)


@pytest.mark.parametrize("micro, gas", [(4, 1), (2, 2), (1, 4)])
def test_one_call_per_mini_batch_and_its_token_means(reference_server, tiny_model_dir, micro, gas):
    client = ArcticRLClient.from_config(main_config(tiny_model_dir, reference_server.url, micro=micro))
    try:
        training = client.job_ids["training"]
        info = requests.get(f"{reference_server.url}/job/{training}", timeout=30).json()
        assert info["gradient_accumulation_steps"] == gas
        metrics = tu.get(client.update_actor(train_data(client)), "metrics")
        info = requests.get(f"{reference_server.url}/job/{training}", timeout=30).json()
        assert client.step == info["global_step"] == 2 and info["pending_forward_backward"] == 0
        assert all(abs(v) < 1e-5 for v in metrics["actor/ppo_kl"]), metrics["actor/ppo_kl"]
        assert all(v == 0.0 for v in metrics["actor/pg_clipfrac"])
        if gas == 1:
            _GAS1.update({k: list(v) for k, v in metrics.items()})
        elif _GAS1:
            for name in ("actor/pg_loss", "loss", "actor/ppo_kl", "actor/pg_clipfrac"):
                assert metrics[name] == pytest.approx(_GAS1[name], abs=1e-5), name
        doubled = tu.get(client.update_actor(train_data(client, weights=2.0)), "metrics")
        zeroed = tu.get(client.update_actor(train_data(client, weights=0.0)), "metrics")
        assert abs(metrics["actor/pg_loss"][0]) > 1e-2
        assert doubled["actor/pg_loss"] == pytest.approx([2 * v for v in metrics["actor/pg_loss"]], abs=1e-5)
        assert zeroed["actor/pg_loss"] == [0.0, 0.0]
        assert client.save_checkpoint()["global_step"] == client.step == 6
    finally:
        client.destroy()
    assert requests.get(reference_server.url + "/status", timeout=30).json()["jobs"] == {}
