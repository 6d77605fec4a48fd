"""``benchmarks/device/server_calls.sh``: which of the reference server's log lines a GPU run brings back.

The lines are the server's own formats (``arctic_rl/server``); a run's memory is lined up with them by time, so a
checkpoint save (with the memory it used while it ran), the process group's backend, the jobs' warm-ups and the
garbage collector's freezes must be among them."""

from __future__ import annotations

import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "server_calls.sh"

KEPT = [
    "2026-12-06 07:50:01,000 INFO arctic_rl.server: process group: cpu:gloo,cuda:nccl, world size 1 (in-process store)",
    "2026-12-06 07:57:31,969 INFO arctic_rl.server: forward job=3 (training) rows=128 tokens=22272 0.07s",
    "2026-12-06 07:57:33,016 INFO arctic_rl.server: forward-backward job=3 loss_fn=verl_grpo rows=128 0.68s",
    "2026-12-06 07:57:33,054 INFO arctic_rl.server: step job=3 global_step=4 grad_norm=0.62 lr=2e-05 0.02s",
    "2026-12-06 07:57:33,119 INFO arctic_rl.server: weight-sync 3 -> [1] versions={1: 5} 0.03s",
    "2026-12-06 07:57:34,670 INFO arctic_rl.server: vLLM sampler asleep (level 1): 1.52 GB freed in 0.24s",
    ("2026-12-06 07:57:39,299 INFO arctic_rl.server: save: the device's use rose by 772 MiB at most during the save "
     "(772 MiB of it outside PyTorch's allocator, whose reserve rose by 0 MiB at most); 0 MiB left at its end; at its "
     "start the allocator held 1024 MiB of freed blocks cached (in use on the device, not by tensors)"),
    "2026-12-06 07:57:39,300 INFO arctic_rl.server: save job=3 -> /ck/run/checkpoint-5 (step 5) 3.41s",
    "2026-12-06 07:58:00,000 INFO arctic_rl.server: load-checkpoint job=3 <- /ck/run/checkpoint-5 (step 5) 1.20s",
    ("2026-12-06 07:58:01,000 INFO arctic_rl.server: training job: warm-up of 9 calls on synthetic batches and at the "
     "client's batch shape (/forward 128 rows x 1600 + 128) in 201.3s (compiles before step 1); 0.50 GB of cached "
     "blocks released"),
    ("2026-12-06 07:58:02,000 INFO arctic_rl.server: gc: 2210417 objects frozen after the warm-up of job 3 in 0.61s "
     "(later collections skip them)"),
]
DROPPED = [
    "2026-12-06 07:57:30,000 INFO uvicorn.access: 127.0.0.1:5000 - \"POST /generate HTTP/1.1\" 200",
    "2026-12-06 07:50:02,000 INFO arctic_rl.server: training job: training_config is not used",
]


def test_the_calls_saves_and_backend_are_kept_and_the_rest_dropped(tmp_path):
    (tmp_path / "run" / "server").mkdir(parents=True)
    (tmp_path / "run" / "server" / "server.log").write_text("\n".join(KEPT[:4] + DROPPED + KEPT[4:]) + "\n")
    out = tmp_path / "calls.log"
    subprocess.run(["bash", str(SCRIPT), str(tmp_path / "run"), str(out)], check=True, timeout=60)
    assert out.read_text().splitlines() == KEPT


def test_a_run_without_a_server_writes_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    out = tmp_path / "calls.log"
    subprocess.run(["bash", str(SCRIPT), str(tmp_path / "run"), str(out)], check=True, timeout=60)
    assert not out.exists()
