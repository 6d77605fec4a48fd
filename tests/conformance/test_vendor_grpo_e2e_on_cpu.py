"""Two GRPO steps of stock verl 0.9.1 through our adapter against the vendor's own Arctic RL v2 server.

The command is what a user with a real Arctic RL deployment types::

    python -m verl.remote_backend.main_ppo <stock GRPO overrides> remote_backend=arctic \\
        remote_backend.server.url=<vendor url>

The server is the vendor's code (Arctic-Platform snapshot, served on CPU by the shared kit's
``run_vendor_server.py``; the ``vendor_server`` fixture). The task is the reverse-text example's
(its data builder, model size and reward file), untrained: two steps, one mini-batch of 4 rows per
step split into 2 micro-batches (GAS 2), ZoRRO off and on. The run must finish, log both steps,
and the vendor's own account must agree: one ``/forward-backward`` and one ``/step`` per mini-batch,
the ``global_step`` its ``/save`` answers (verl checkpoints at the last step) equal to the run's step
count, the sampler's log-probs equal to the old log-probs before the first update, and no job left on
the server.

Run by hand (prints the command it runs)::

    pytest -m e2e tests/conformance/test_vendor_grpo_e2e_on_cpu.py -s
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.support.e2e import check_steps, run_recipe, tiny_grpo_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN_TIMEOUT_S = 1500


def grpo_overrides(task: dict[str, Path], out: Path, url: str, *, zorro: bool) -> list[str]:
    overrides = [
        # 2 prompts x n=2: one mini-batch of 4 rows per step, 2 micro-batches of 2 rows (GAS 2); a checkpoint
        # at the last step, so that the vendor's /save answers its global_step
        *tiny_grpo_overrides(task, out, micro_batch=2, save_freq=2),
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.rollout.name=vllm",
        "remote_backend=arctic",
        f"remote_backend.server.url={url}",
        f"remote_backend.train.zorro_train.enable={str(zorro).lower()}",
        f"remote_backend.train.checkpoint_path={out / 'vendor_checkpoints'}",
        # every other remote_backend key at its default, as a user with a real deployment would have it
    ]
    if zorro:  # checkpointed layers re-run without ZoRRO's shared prompt keys: ZoRRO needs it off
        overrides.append("actor_rollout_ref.model.enable_gradient_checkpointing=False")
    return overrides


@pytest.mark.timeout(RUN_TIMEOUT_S + 180)
@pytest.mark.parametrize("zorro", [False, True], ids=["zorro_off", "zorro_on"])
def test_two_grpo_steps_against_the_vendor_server(vendor_server, reverse_text_task, tmp_path, zorro):
    traced_before = len(vendor_server.trace_lines())

    def vendor_side() -> str:
        trace = vendor_server.trace_lines()[traced_before:]
        return (f"--- vendor exchanges: {[(r['path'], r['status']) for r in trace][-20:]}\n"
                f"--- vendor log:\n{vendor_server.log_tail()}")

    # the vendor server has no authentication: the run's environment drops ARCTIC_RL_TOKEN
    steps, _ = run_recipe(grpo_overrides(reverse_text_task, tmp_path / "run", vendor_server.url, zorro=zorro),
                          cwd=tmp_path, timeout=RUN_TIMEOUT_S, explain=vendor_side)
    trace = vendor_server.trace_lines()[traced_before:]
    check_steps(steps, [1, 2], ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
                                "critic/score/mean", "response_length/mean", "timing_s/update_actor"))
    for metrics in steps.values():
        assert metrics["actor/lr"] == pytest.approx(1e-3)
    # before the first update the sampler's log-probs (the vendor's vLLM-style /generate answer) and the old
    # log-probs (/forward, ZoRRO layout when on) are the same policy's: they agree up to bf16 rounding
    assert steps[1]["training/rollout_probs_diff_max"] < 0.05, steps[1]["training/rollout_probs_diff_max"]

    def calls(path: str) -> list[dict]:
        return [r for r in trace if r["path"] == path]

    assert all(r["status"] == 200 for r in trace if r["path"] != "/destroy"), \
        [(r["path"], r["status"]) for r in trace if r["status"] != 200]
    assert len(calls("/forward-backward")) == 2, "one /forward-backward per mini-batch (the vendor splits it by GAS)"
    assert [r["rows"] for r in calls("/forward-backward")] == [4, 4]
    assert len(calls("/step")) == 2
    saves = [r for r in calls("/save") if "answer" in r]
    assert saves, "verl's checkpoint at the last step never reached the vendor's /save"
    assert saves[-1]["answer"]["global_step"] == 2, "the vendor's optimizer step count differs from the run's"
    assert requests.get(f"{vendor_server.url}/status", timeout=30).json()["jobs"] == {}, "jobs left on the server"
