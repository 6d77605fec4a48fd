"""``verl_settings.VerlSettings``: the verl fields a remote adapter reads, taken from verl 0.9.1's own full PPO config
(both vendors' adapters build from it)."""

from __future__ import annotations

import pytest

from tests.support.arctic import verl_main_config
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.workers.remote_client.common.verl_settings import VerlSettings


def test_verl_settings_read_from_verls_own_config():
    v = VerlSettings.from_main_config(verl_main_config({
        "actor_rollout_ref": {
            "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 2,
                      "optim": {"lr": 3e-6, "betas": [0.9, 0.95]}},
        },
    }))
    assert (v.rollout_n, v.ppo_mini_batch_size, v.ppo_micro_batch_size_per_gpu, v.ppo_epochs) == (2, 4, 2, 2)
    assert v.optim.lr == 3e-6 and v.optim.betas == (0.9, 0.95) and v.optim.eps == 1e-8  # verl has no eps
    assert v.optim.clip_grad == 1.0 and v.loss_agg_mode == "token-mean" and v.clip_ratio_c == 3.0
    assert v.model_path == "/models/tiny" and v.tokenizer_path == "/models/tiny"


def test_conflicting_clipping_norms_are_an_error():
    config = verl_main_config({"actor_rollout_ref": {"actor": {"grad_clip": 0.5, "optim": {"clip_grad": 0.3}}}})
    with pytest.raises(RemoteBackendConfigError, match="conflicting"):
        VerlSettings.from_main_config(config)
