"""End to end: a GRPO job submitted to a running Ray cluster with ``examples/ray_cluster/submit_grpo.sh``.

The cluster path of the README, on one machine: a Ray head (``ray start --head --block`` on
127.0.0.1, private temp dir and ports, so it cannot meet another Ray of this machine), the reference
Arctic RL server as a separate long-lived process (``python -m arctic_rl.server``), and the submit
script as a user runs it, with the reverse-text recipe for 2 steps, once per ``PACKAGE_MODE``:

* ``preinstalled`` -- the nodes' environment (this venv) already has the package;
* ``pip`` -- Ray clones the venv for the job and pip-installs the uploaded checkout into it.

Each job must reach SUCCEEDED through Ray's job API, its logs must hold the recipe's progress line
for both steps, and verl's metrics file must have the two steps. Everything started here (the Ray
head and every process under it, the server) is stopped at the end, also when a test fails.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from server_process import free_port, running_server

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SUBMIT = REPO_ROOT / "examples" / "ray_cluster" / "submit_grpo.sh"
RECIPE = "examples/grpo/run_reverse_text_grpo_arl_local.sh"
VENV_BIN = pathlib.Path(sys.executable).parent
# Logical CPUs of the head: the job driver's forwarder bundle, TransferQueue units and headroom need 5.
HEAD_CPUS = 8
CLUSTER_START_S = 240
RAY_START_ATTEMPTS = 3
# A job builds the tiny model and its warm start when they are absent (the first one), starts verl on
# the cluster and runs 2 steps; on 2 shared cores that is a few minutes, the pip mode adds a venv copy.
JOB_TIMEOUT_S = 1500

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@dataclass
class Cluster:
    dashboard_url: str
    proc: subprocess.Popen
    log: pathlib.Path


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Ray's job drivers run in sessions of their own)."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_running(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the process and every descendant, by pid; SIGKILL whatever is left after 30 s."""
    pids = {proc.pid, *_descendants(proc.pid)}
    for sig, grace_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        pids |= set(_descendants(proc.pid))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap our own child
            if not any(_is_running(pid) for pid in pids):
                return
            time.sleep(0.5)


def _env() -> dict[str, str]:
    """The environment of the head, the submit script and (through the head) the jobs. Ray >= 2.5x turns
    token authentication on for a new cluster whenever a token file exists (~/.ray/auth_token, left by
    any earlier ``ray.init`` of this user), and then every client must send it; this private cluster on
    127.0.0.1 runs without, so that no token of another Ray on this machine is involved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled")
    return env


def _wait_for_job_api(url: str, proc: subprocess.Popen, log: pathlib.Path, timeout_s: float) -> None:
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            JobSubmissionClient(url).list_jobs()
            return
        except Exception:  # noqa: BLE001 - not up (yet)
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray head's job API did not answer in {timeout_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(2)


def _start_head(temp_dir: str) -> tuple[subprocess.Popen, pathlib.Path, str]:
    """``ray start --head --block`` on free ports; returns once the node is up (the command blocks)."""
    log = pathlib.Path(temp_dir) / "head.log"
    ports = {name: free_port() for name in ("port", "dashboard-port", "dashboard-agent-listen-port",
                                             "dashboard-agent-grpc-port", "ray-client-server-port",
                                             "node-manager-port", "object-manager-port", "metrics-export-port",
                                             "runtime-env-agent-port")}
    # the workers' 100 ports: below Linux's ephemeral range (32768+, where free_port()'s come from) when it is
    # the default, and never over a port picked above (Ray refuses to start on such an overlap)
    rng = random.Random()
    worker_base = rng.randrange(20000, 32600, 100)
    while any(worker_base <= port <= worker_base + 99 for port in ports.values()):
        worker_base = rng.randrange(20000, 32600, 100)
    cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--num-cpus={HEAD_CPUS}", "--num-gpus=0",
           f"--temp-dir={temp_dir}", f"--min-worker-port={worker_base}", f"--max-worker-port={worker_base + 99}",
           "--disable-usage-stats", *(f"--{name}={port}" for name, port in ports.items())]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=temp_dir, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + CLUSTER_START_S
    while proc.poll() is None and "block forever" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(1)
    return proc, log, f"http://127.0.0.1:{ports['dashboard-port']}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    from ray.job_submission import JobSubmissionClient

    temp_dir = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    kept_logs = tmp_path_factory.mktemp("ray_head_logs")  # Ray's logs outlive the temp dir, for a failure
    # Ray gives its node a fixed 30 s to register (on a loaded machine `ray start` then gives up), and a port
    # picked free can be taken before Ray binds it: try again, on fresh ports.
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        proc, log, url = _start_head(temp_dir)
        retry = ("timed out during startup", "used by other components")  # a loaded machine; a port taken meanwhile
        if proc.poll() is None or not any(r in log.read_text() for r in retry) or attempt == RAY_START_ATTEMPTS:
            break
        _stop_tree(proc)
        shutil.copy(log, kept_logs / f"head-attempt{attempt}.log")
    try:
        _wait_for_job_api(url, proc, log, CLUSTER_START_S)
        yield Cluster(url, proc, log)
    finally:
        try:
            client = JobSubmissionClient(url)
            for job in client.list_jobs():
                if not job.status.is_terminal():
                    client.stop_job(job.submission_id)
        except Exception:  # noqa: BLE001, S110 - the head may be gone already; the processes go next
            pass
        _stop_tree(proc)
        shutil.copytree(temp_dir, kept_logs / "ray", ignore=shutil.ignore_patterns("*.sock", "sockets", "runtime_resources"),
                        dirs_exist_ok=True, ignore_dangling_symlinks=True, symlinks=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("arctic_server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> pathlib.Path:
    """Shared by the jobs: the first builds the model, warm start and data, the second reuses them."""
    return tmp_path_factory.mktemp("ray_jobs")


@pytest.mark.timeout(JOB_TIMEOUT_S + 300)
@pytest.mark.parametrize("package_mode", ["preinstalled", "pip"])
def test_submitted_grpo_job_succeeds(cluster: Cluster, server, out_dir: pathlib.Path, package_mode: str):
    from ray.job_submission import JobStatus, JobSubmissionClient

    _wait_for_job_api(cluster.dashboard_url, cluster.proc, cluster.log, 120)  # still answering (a loaded box)
    submission_id = f"test_{package_mode}_{uuid.uuid4().hex[:8]}"
    run_name = f"ray_{package_mode}"
    env = _env()
    env.update(RAY_ADDRESS=cluster.dashboard_url, ARCTIC_RL_URL=server.url, RECIPE=RECIPE, PACKAGE_MODE=package_mode,
               OUT_DIR=str(out_dir), STEPS="2", RUN_NAME=run_name, SUBMISSION_ID=submission_id, NO_WAIT="1",
               PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SUBMIT)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    client = JobSubmissionClient(cluster.dashboard_url)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = client.get_job_status(submission_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(5)
        status = client.get_job_status(submission_id)
    logs = client.get_job_logs(submission_id)
    (out_dir / f"{submission_id}.log").write_text(logs)
    if not status.is_terminal():
        client.stop_job(submission_id)
    info = client.get_job_info(submission_id)
    assert status == JobStatus.SUCCEEDED, f"{status}: {info.message}\n{logs[-6000:]}"

    run_dir = out_dir / "runs" / run_name
    for step in (1, 2):
        assert f"[remote_backend] step {step}/2 | reward" in logs, logs[-6000:]
    assert f"log:     {run_dir}/run.log" in logs  # the recipe's header; its full output went to that file
    assert "step:1 -" not in logs and "step:1 -" in (run_dir / "run.log").read_text()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
