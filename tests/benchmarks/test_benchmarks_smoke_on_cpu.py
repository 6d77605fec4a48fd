"""Every script in ``benchmarks/`` runs, on a CPU, in its smoke mode: tiny sizes, seconds to a minute each.

The scripts measure on a GPU or for minutes; what breaks them between measurements is code that moved
(an adapter function renamed, a server option changed). Each runs here as a user runs it
(``python benchmarks/<script>.py <smoke flags>``) in a subprocess, and must exit 0 and print or write
what it exists to report. The GPU-only scripts take their CPU path: ``gen_throughput.py --cpu-smoke``
(the transformers sampler behind the real server), ``gpu_throughput.py --device cpu --tiny``,
``gpu_grpo_loop.py --cpu-smoke --bare`` (which runs ``grpo_bare.py``'s components with transformers'
``generate`` for vLLM) and ``grpo_report.py`` on what that loop wrote.

A script added to ``benchmarks/`` without an entry in :data:`SMOKE` fails
:func:`test_every_benchmark_script_has_a_smoke_run`. ``benchmarks/device/`` holds the device runner's
scripts, not benchmarks, and is not covered here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"

#: script -> (arguments, with {out} for a fresh output folder; texts its output must hold)
SMOKE: dict[str, tuple[list[str], list[str]]] = {
    "gen_throughput.py": (["--cpu-smoke", "--out", "{out}"], ['"weight_sync"', "| 2 x 4 |"]),
    "gc_after_warm_up.py": (["--smoke", "--repeat", "1"], ["| after the freeze (", "the baseline's collection"]),
    "generate_answer.py": (["--smoke"], ["| 4 x 16 | 64 |", "compact vs vendor, engine + JSON"]),
    # the budget bounds a GPU run; the tiny CPU run takes ~20 s and must not skip a section
    "gpu_throughput.py": (["--device", "cpu", "--tiny", "--out", "{out}", "--budget-s", "600", "--repeats", "1",
                           "--warmup", "1"], ["profile plain_main", "server SamplingEngine, batch 8"]),
    "gpu_grpo_loop.py": (["--out", "{out}", "--cpu-smoke", "--zorro", "off", "--bare", "--steps", "1",
                          "--warmup", "0"], []),
    "load.py": (["--clients", "2", "--seconds", "3"], ["errors: 0;", "update_weights"]),
    # the GPU runs themselves: tests/benchmarks/test_max_model_on_cpu.py runs its loop with stand-in scripts
    "max_model.py": (["--dry-run", "--work", "{out}", "--sizes", "0.6b", "--env-file", ""],
                     ["RUN_NAME=0.6b_arctic_base", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"]),
    "memory_probe_report.py": (["--smoke"], ["| POST /generate | 10.00 | 6.00 | 2.00 | 4.00 | 0.00 | 4.00 |",
                                             "### the least in use: 6.00 GiB"]),
    "overlap_contention.py": (["--cpu-smoke", "--out", "{out}"], ["| alone |", "| python-thread |",
                                                                 "| python-process |"]),
    "real_model_report.py": (["--smoke"], ["curves:"]),
    "step_overhead.py": (["--smoke"], ["Part A: GRPO step through ArcticRLClient", "client: DSSST1 encode",
                                       "Part B: rollout replica server", "concurrent vs sequential"]),
    "transfer_queue_fields.py": (["--rows", "8", "--prompt", "6", "--response", "8", "--repeats", "1"],
                                 ["every field (baseline)", "Arctic update_actor's", "  advantages alone"]),
    "wire.py": (["--batch", "4", "--seq", "64", "--repeats", "2"], ["dssst1 (bytearray in)", "torch.save+load"]),
    "zorro.py": (["--quick"], ["CHECK max relative error ZoRRO vs plain (log-probs, gradients)"]),
    "zorro_gpu_passes.py": (["--cpu-smoke"], ["| 8 | fwd+bwd |", "max |ZoRRO - plain| log-prob"]),
}
#: scripts that are modules of another script, run through it
RUN_BY = {"grpo_bare.py": "gpu_grpo_loop.py", "grpo_report.py": "gpu_grpo_loop.py",
          "max_model_report.py": "max_model.py", "qwen3_random.py": "max_model.py"}


def run_script(script: str, args: list[str], timeout: float = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{output[-6000:]}"
    return output


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == set(SMOKE) | set(RUN_BY), (sorted(scripts - set(SMOKE) - set(RUN_BY)), "have no smoke run")


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_in_its_smoke_mode(script, tmp_path):
    args, expected = SMOKE[script]
    out = tmp_path / "out"
    output = run_script(script, [a.replace("{out}", str(out)) for a in args])
    for text in expected:
        assert text in output, f"{script}: {text!r} not in its output:\n{output[-4000:]}"
    if script == "gen_throughput.py":
        results = json.loads((out / "gen_results.json").read_text())
        assert results["transformers_b2_n4"]["tokens"] > 0 and len(results["weight_sync"]) == 3
        # interleaved: both sides timed in every round, and the server's own seconds read from its log
        assert len(results["rounds_b2_n4"]) == 2 and results["bare_b2_n4"]["tokens"] == 8
        assert len(results["transformers_b2_n4"]["server_s"]) == 2
    if script == "gpu_throughput.py":
        results = json.loads((out / "gpu_results.json").read_text())
        assert "plan_errors" not in results and results["generate"], sorted(results)
        assert "# budget: skipping" not in output
    if script == "gpu_grpo_loop.py":
        loop, bare = out / "loop_zorro_off.json", out / "bare.json"
        assert loop.is_file() and bare.is_file(), sorted(p.name for p in out.iterdir())
        report = run_script("grpo_report.py", [str(loop), str(bare)])
        assert "generate" in report and "update" in report, report[-3000:]


def test_gen_throughput_speaks_the_adapters_wire_too(tmp_path):
    """``--wire dssst1 --answer compact``: the server's body and answer as the adapter's v2 dialect sends and asks
    for them on our server (DSSST1 each way, the compact answer)."""
    out = tmp_path / "out"
    run_script("gen_throughput.py", ["--cpu-smoke", "--wire", "dssst1", "--answer", "compact", "--out", str(out)])
    results = json.loads((out / "gen_results.json").read_text())
    assert results["wire"] == "dssst1" and results["answer"] == "compact"
    assert results["transformers_b2_n4"]["tokens"] == 8
