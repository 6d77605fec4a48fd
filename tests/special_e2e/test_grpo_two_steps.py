"""Two GRPO steps of stock verl 0.9.1 on the Arctic RL reference server, on CPU, ZoRRO on and off.

The command is exactly what a user types (``python -m verl.remote_backend.main_ppo <stock GRPO
overrides> remote_backend=arctic``); the recipe even says ``rollout.name=vllm``, tensor parallel 2
and 8 GPUs per node, which the entry point replaces. ``remote_backend.server.url`` is left null,
so the adapter starts a local reference server (real generation with transformers, real DeepSpeed
training, real log-probs) and stops it at the end.

The tiny task: ``a+b=`` prompts, a custom reward function file (``reward.custom_reward_function``),
a char-level Qwen3 built on the spot. The run is parsed from verl's console logger.

Run by hand (prints the command it runs)::

    pytest -m e2e tests/special_e2e/test_grpo_two_steps.py -s
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.e2e import build_task, bundled_server_log, check_steps, run_recipe, tiny_grpo_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def grpo_overrides(task: dict[str, Path], out: Path, *, zorro: bool) -> list[str]:
    overrides = [
        *tiny_grpo_overrides(task, out, micro_batch=4),
        # settings of a stock GPU recipe the remote backend must take in its stride
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=8",
        # the remote backend
        "remote_backend=arctic",
        f"remote_backend.train.zorro_train.enable={str(zorro).lower()}",
        "remote_backend.train.deepspeed.bf16=false",
    ]
    if zorro:  # checkpointed layers re-run without ZoRRO's shared prompt keys: ZoRRO needs it off
        overrides.append("actor_rollout_ref.model.enable_gradient_checkpointing=False")
    return overrides


def check_sampler_sleeps(server_log: str) -> None:
    """verl's sync mode (``rollout.free_cache_engine``, its default) sleeps the sampler after each generation
    phase; the rollout server wakes it (all parts) before the next phase's first ``/generate``, and the weight
    sync in between wakes its weights."""
    asleep, sleeps, wakes, weight_wakes = False, 0, 0, 0
    for line in server_log.splitlines():
        if "sleep-inference job=" in line:
            asleep, sleeps = True, sleeps + 1
        elif "wake-inference job=" in line and "tags=all" in line:
            asleep, wakes = False, wakes + 1
        elif "wake-inference job=" in line and "tags=weights" in line:
            weight_wakes += 1
        elif "generate job=" in line:
            assert not asleep, "a /generate reached the sampler while it slept"
    assert sleeps >= 2 and wakes >= 2 and weight_wakes >= 2, (sleeps, wakes, weight_wakes)


@pytest.mark.parametrize("zorro", [False, True], ids=["zorro_off", "zorro_on"])
def test_two_grpo_steps_on_the_reference_server(tmp_path, zorro):
    task = build_task(tmp_path / "task")
    steps, output = run_recipe(grpo_overrides(task, tmp_path / "run", zorro=zorro), cwd=tmp_path, timeout=1500)
    check_steps(steps, [1, 2], ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
                                "actor/entropy", "actor/kl_loss", "perf/mfu/actor", "critic/score/mean",
                                "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/ref"))
    for step, metrics in steps.items():
        assert metrics["actor/lr"] == pytest.approx(1e-3)
        for phase in ("old_log_prob", "update_actor", "update_weights"):  # where each phase's time went
            server, adapter = metrics[f"timing_s/{phase}/server"], metrics[f"timing_s/{phase}/adapter"]
            assert 0 < server <= metrics[f"timing_s/{phase}/http"] <= adapter, (phase, server, adapter)
        for phase in ("old_log_prob", "update_actor"):  # the worker method (verl's bridge) within verl's phase
            assert metrics[f"timing_s/{phase}/adapter"] <= metrics[f"timing_s/{phase}/worker"], phase
            assert metrics[f"timing_s/{phase}/worker"] <= metrics[f"timing_s/{phase}"], phase
        # generation: the time the server had at least one of the step's /generate calls, within verl's phase
        assert 0 < metrics["timing_s/gen/backend_busy"] <= metrics["timing_s/gen"]
        assert metrics["perf/remote_backend/gen_calls"] >= 1 and metrics["timing_s/gen/server_sum"] > 0
        # the phase's window: hand-over, first call, last answer, samples back; the calls within it
        window = [metrics[f"timing_s/gen/{part}"] for part in ("to_first_call", "calls_span", "after_last_answer")]
        assert min(window) >= 0 and metrics["timing_s/gen/submit"] >= 0, window
        assert sum(window) <= metrics["timing_s/gen/submit"] + metrics["timing_s/gen"], window
        assert metrics["timing_s/gen/backend_busy"] <= window[1] + 0.05, window
        # the sampler slept after the phase and woke before it (verl's free_cache_engine, sync mode)
        assert metrics["timing_s/gen/sampler_sleep"] > 0 and metrics["timing_s/gen/sampler_wake"] > 0
        assert 0 < metrics["response_length/mean"] <= 8
        if metrics["critic/advantages/max"] > metrics["critic/advantages/min"]:
            assert metrics["actor/grad_norm"] > 0  # a real backward pass on the server
        elif step == 1:  # every sample of every group scored the same, and the actor is still the reference:
            assert metrics["actor/grad_norm"] == 0  # GRPO and the KL loss have nothing to push
        # the adapter reports the tokens the server really computed: ZoRRO runs each GRPO group's
        # shared prompt once (fewer than the batch holds); the plain pass every row, padding included
        computed, total = metrics["actor/arctic/tokens_computed"], metrics["global_seqlen/mean"]
        assert (computed < total) if zorro else (computed >= total), (computed, total)
    assert "[remote_backend] actor_rollout_ref.rollout.name=vllm replaced by actor_rollout_ref.rollout.name=arctic" in output
    assert "remote backend 'arctic' destroyed" in output
    assert re.search(r"\d+ agent-loop workers started in [\d.]+s \(before step 1\)", output), "no wait before step 1"
    # verl hands update_actor a meta naming every field; the dispatch narrows it to what the adapter reads
    update_read = re.search(r"forwarder update_actor reads the batch's \d+ tensor fields (\[[^\]]*\]); left out: "
                            r"\d+ not read by the backend \[[^\]]*\], (\d+) not tensors", output)
    assert update_read and "'advantages'" in update_read[1] and "'rm_scores'" not in update_read[1], update_read
    assert int(update_read[2]) > 0
    server_log = bundled_server_log(tmp_path / "run")
    assert "loss_fn=verl_grpo" in server_log and "step job=" in server_log
    if zorro:
        assert "ZoRRO requested but not possible" not in server_log
    check_sampler_sleeps(server_log)
    for job_type in ("log_prob", "training"):  # created after the sampler: it sleeps while they are built
        assert f"asleep while a {job_type} job is built" in server_log, job_type
    assert re.search(r"\[remote_backend\] step 2/2 \| reward -?\d", output), "no progress line"
