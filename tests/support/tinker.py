"""One running Tinker peer per test session: SkyRL's Tinker API server on CPU, driven by the official SDK.

The session fixture :func:`tinker_peer` (exposed to every test by ``tests/conftest.py``) builds the
server's own venv with ``<shared>/peers/tinker/setup.sh`` (into ``$XDG_CACHE_HOME/tinker-peer/venv``,
or ``~/.cache/...``: idempotent, ~1 min cold), writes a tiny Qwen3 under a path the SDK's tokenizer
heuristics accept, starts the server on a free loopback port with ``start.sh`` and stops it with
``stop.sh`` when the session ends. The peer tests and the Tinker end-to-end run share it, so the
server starts once and every XLA program it compiles for one shape serves both (keep to the shapes
in :data:`PEER_SHAPES`).

Under pytest-xdist each worker is a session of its own and starts its own peer when its tests need
one (CI's ``--dist loadscope`` may put the peer tests and the end-to-end run on different workers):
two workers driving one peer at once failed once in set-up for a reason not found, and a second peer
costs one start (~10 s with the JAX cache warm) and its first compiles. Outside CI a missing kit or SDK skips; under CI (``CI=true``) it fails, so a
green CI means these tests ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.e2e import build_task, check_steps, run_recipe

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("VERL_REMOTE_BACKEND_SHARED", REPO.parent / "shared"))
KIT = SHARED / "peers" / "tinker"
#: any key of the hosted service's shape: the peer checks nothing, the SDK wants the prefix
PEER_API_KEY = "tml-local-peer"
#: The shapes every user of the shared peer keeps to, so that each XLA program compiles once per server:
#: training batches of 4 rows (the peer's micro-batch) of at most 32 tokens (its first sequence bucket),
#: one ``max_tokens`` for sampling, one LoRA rank.
PEER_SHAPES = {"rows": 4, "max_seq_len": 32, "max_tokens": 8, "lora_rank": 8}
#: LoRA slots of the shared peer (one is the base model's): the peer tests and one verl run at a time
#: each hold one or two, and the service frees a slot only after its session stops heartbeating.
PEER_LORA_SLOTS = 16


@dataclasses.dataclass(frozen=True)
class TinkerPeer:
    """A running peer: its base URL and the model directory it serves (also the ``base_model`` name)."""

    url: str
    model: Path


def skip_or_fail(text: str) -> None:
    """Skip a test whose tools are missing; under CI fail instead, so that a green CI means it ran."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(text, pytrace=False)
    pytest.skip(text)


def require_peer_kit() -> Path:
    """The peer kit's directory; skips (fails under CI) without the kit or the ``tinker`` SDK."""
    try:
        import tinker  # noqa: F401
    except ImportError:
        skip_or_fail("the tinker SDK is not installed (bash scripts/install.sh --test installs tinker==0.24.1)")
    if not (KIT / "start.sh").exists():
        skip_or_fail(f"the Tinker peer kit is missing at {KIT} (set VERL_REMOTE_BACKEND_SHARED)")
    return KIT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_peer_model(root: Path) -> Path:
    """The tiny Qwen3 under ``root/peer/tiny-qwen3`` (three or more ``/`` and no ``:``: the SDK's
    ``get_tokenizer`` rewrites two-slash names). The same weights as ``tests.support.e2e.build_task``'s model."""
    from arctic_rl.tiny_models import build_tiny_model

    out = root / "peer" / "tiny-qwen3"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.json").exists():
        build_tiny_model(out, "qwen3", seed=0)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _start_peer(root: Path) -> dict:
    """Set up (cached) and start a peer serving the tiny Qwen3; returns what :func:`_stop_peer` and
    the other workers need."""
    kit = require_peer_kit()
    t0 = time.monotonic()
    setup = subprocess.run(["bash", str(kit / "setup.sh")], capture_output=True, text=True, timeout=1200,
                           check=False)
    if setup.returncode != 0:
        pytest.fail(f"tinker peer setup.sh failed:\n{setup.stdout[-2000:]}\n{setup.stderr[-3000:]}", pytrace=False)
    model = build_peer_model(root)
    state = root / f"state-{os.getpid()}"
    port = _free_port()
    env = {**os.environ, "TINKER_PEER_MAX_LORA_ADAPTERS": str(PEER_LORA_SLOTS)}
    start = subprocess.run(["bash", str(kit / "start.sh"), str(model), str(port), str(state)], capture_output=True,
                           text=True, timeout=600, env=env, check=False)
    if start.returncode != 0 or f"READY {port}" not in start.stdout:
        _stop_peer(state)
        pytest.fail(f"tinker peer did not start:\n{start.stdout[-2000:]}\n{start.stderr[-3000:]}", pytrace=False)
    pid = int((state / "server.pid").read_text().strip())
    print(f"[tinker peer] set up and started in {time.monotonic() - t0:.1f} s on port {port}", file=sys.stderr)
    return {"url": f"http://127.0.0.1:{port}", "model": str(model), "state": str(state), "pid": pid, "users": 0}


def _stop_peer(state: Path) -> None:
    subprocess.run(["bash", str(KIT / "stop.sh"), str(state)], capture_output=True, timeout=120, check=False)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another worker starts or stops the peer
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def shared_peer(root: Path) -> Iterator[TinkerPeer]:
    """A peer under ``root`` shared by every process that enters this with the same ``root``: the first
    starts it, the last to leave stops it (``root/peer.json`` holds its address and the user count)."""
    root.mkdir(parents=True, exist_ok=True)
    lock, record = root / "lock", root / "peer.json"
    with _locked(lock):
        peer = json.loads(record.read_text()) if record.exists() else None
        if peer is None or not _alive(int(peer["pid"])):
            peer = _start_peer(root)
        peer["users"] += 1
        record.write_text(json.dumps(peer))
    try:
        yield TinkerPeer(url=peer["url"], model=Path(peer["model"]))
    finally:
        with _locked(lock):
            current = json.loads(record.read_text()) if record.exists() else {}
            # a record of another server means ours died and was replaced: nothing of ours to release
            if current.get("pid") == peer["pid"]:
                if current["users"] <= 1:
                    _stop_peer(Path(current["state"]))
                    record.unlink()
                else:
                    current["users"] -= 1
                    record.write_text(json.dumps(current))



def tinker_grpo_overrides(task: dict, out, url: str) -> list[str]:
    """The two-step GRPO recipe's overrides through ``remote_backend=tinker`` against the peer at ``url``."""
    # 2 prompts x 2 samples = the peer's 4-row micro-batch; prompt + response <= its 32-token bucket
    overrides = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=True",
        f"data.train_files={task['train']}",
        f"data.val_files={task['val']}",
        "data.train_batch_size=2",
        "data.max_prompt_length=24",
        f"data.max_response_length={PEER_SHAPES['max_tokens']}",
        f"actor_rollout_ref.model.path={task['model']}",
        f"actor_rollout_ref.model.lora_rank={PEER_SHAPES['lora_rank']}",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"reward.custom_reward_function.path={task['reward']}",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=False",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        f"hydra.run.dir={out / 'hydra'}",
        "remote_backend=tinker",
        f"remote_backend.server.url={url}",
    ]
    return overrides


def run_tinker_grpo(tmp_path: Path, peer: TinkerPeer, *extra: str) -> tuple[dict[int, dict[str, float]], str]:
    """The two-step GRPO recipe (:func:`tinker_grpo_overrides`, plus ``extra``) through verl against ``peer``, in
    ``tmp_path``; the task's model is the peer's (the same tiny Qwen3: the service only trains the one it serves).
    Returns the metrics of each step and the run's output."""
    task = {**build_task(tmp_path / "task"), "model": peer.model}
    overrides = [*tinker_grpo_overrides(task, tmp_path / "run", peer.url), *extra]
    return run_recipe(overrides, cwd=tmp_path, timeout=2100, env={"TINKER_API_KEY": PEER_API_KEY})


def check_tinker_grpo(steps: dict[int, dict[str, float]], tmp_path: Path) -> None:
    """What every run of :func:`run_tinker_grpo` logs: two steps of the recipe's update, a Tinker checkpoint at 2."""
    check_steps(steps, [1, 2], ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/lr", "actor/entropy",
                                "critic/score/mean", "response_length/mean", "timing_s/gen", "timing_s/update_actor"))
    for metrics in steps.values():
        assert metrics["actor/lr"] == pytest.approx(1e-3)
        assert 0 < metrics["response_length/mean"] <= PEER_SHAPES["max_tokens"]
    index = tmp_path / "run" / "checkpoints" / "tinker_state_index.json"
    assert index.exists() and '"2": "tinker://' in index.read_text(), "no Tinker checkpoint recorded for step 2"
