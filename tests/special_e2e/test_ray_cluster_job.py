"""End to end: a GRPO job submitted to a running Ray cluster with ``examples/ray_cluster/submit_grpo.sh``.

The try-it path of ``examples/ray_cluster/README.md``, as written there: the ``ray start`` line and
the submit command are read from the README's ``try-it`` block; the test adds only what keeps the
head private (``--block``, a temp dir, free ports, so it cannot meet another Ray of this machine)
and the dashboard switch. The reference Arctic RL server runs as a separate long-lived process
(``python -m arctic_rl.server`` on a free port), and the submit script runs as a user runs it, with
its default recipe (reverse text) and the README's knobs, once per ``PACKAGE_MODE``:

* ``preinstalled`` -- the nodes' environment (this venv) already has the package;
* ``pip`` -- Ray clones the venv for the job and pip-installs the uploaded checkout into it.

Each job must reach SUCCEEDED through Ray's job API, its logs must hold the recipe's progress line
for both steps, and verl's metrics file must have the two steps. The same line without its
``--num-cpus`` (2 logical CPUs, as ``ray start --head`` gives on a 2-core machine) must fail the job
before the server is contacted, with the error naming ``ray start --num-cpus``. Everything started here (the Ray
head and every process under it, the server) is stopped at the end, also when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import shlex
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

from tests.support.server import free_port, running_server

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
README = REPO_ROOT / "examples" / "ray_cluster" / "README.md"
SUBMIT = "examples/ray_cluster/submit_grpo.sh"
VENV_BIN = pathlib.Path(sys.executable).parent
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


@dataclass
class TryIt:
    """The README's try-it block: exported variables, ``ray start`` options, the submit command's knobs."""

    exports: dict[str, str]
    head_options: list[str]
    submit_env: dict[str, str]
    submit_args: list[str]


def _try_it() -> TryIt:
    text = README.read_text()
    assert "<!-- try-it -->" in text, f"{README} lost its try-it block"
    block = text.split("<!-- try-it -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    exports: dict[str, str] = {}
    head: list[str] | None = None
    submit: list[str] | None = None
    for line in block.strip().splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            exports.update(word.split("=", 1) for word in words[1:])
        elif words[:3] == ["ray", "start", "--head"]:
            head = words[2:]
        elif f"bash {SUBMIT}" in line:
            at = words.index("bash")
            submit = words
            assert words[at + 1] == SUBMIT and all("=" in w for w in words[:at]), line
    assert head is not None and submit is not None, block
    at = submit.index("bash")
    return TryIt(exports, head, dict(w.split("=", 1) for w in submit[:at]), submit[at + 2 :])


def test_the_try_it_block_is_what_this_module_runs():
    """The parts the tests below take from the README, so that a change there shows here."""
    try_it = _try_it()
    assert try_it.exports == {"RAY_AUTH_MODE": "disabled"}
    assert try_it.head_options[0] == "--head" and not any(o.startswith("--block") for o in try_it.head_options)
    assert set(try_it.submit_env) == {"ARCTIC_RL_URL", "STEPS"} and try_it.submit_env["STEPS"] == "2"
    assert "RECIPE" not in try_it.submit_env  # the script's default recipe needs no data


def _env() -> dict[str, str]:
    """The environment of the head, the submit script and (through the head) the jobs. Ray >= 2.5x turns
    token authentication on for a new cluster whenever a token file exists (~/.ray/auth_token, left by
    any earlier ``ray.init`` of this user), and then every client must send it; this private cluster on
    127.0.0.1 runs without, so that no token of another Ray on this machine is involved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **_try_it().exports)  # RAY_AUTH_MODE=disabled
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


def _start_head(temp_dir: str, head_options: list[str]) -> tuple[subprocess.Popen, pathlib.Path, str]:
    """``ray start <head_options> --block`` on free ports; returns once the node is up (the command blocks)."""
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
    # the README's line, plus: block (the fixture owns the process), a private temp dir and ports
    cmd = [str(VENV_BIN / "ray"), "start", *head_options, "--block", "--include-dashboard=true",
           f"--temp-dir={temp_dir}", f"--min-worker-port={worker_base}", f"--max-worker-port={worker_base + 99}",
           "--disable-usage-stats", *(f"--{name}={port}" for name, port in ports.items())]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=temp_dir, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + CLUSTER_START_S
    while proc.poll() is None and "block forever" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(1)
    return proc, log, f"http://127.0.0.1:{ports['dashboard-port']}"


@contextlib.contextmanager
def _running_head(tmp_path_factory, head_options: list[str]) -> Iterator[Cluster]:
    from ray.job_submission import JobSubmissionClient

    temp_dir = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    kept_logs = tmp_path_factory.mktemp("ray_head_logs")  # Ray's logs outlive the temp dir, for a failure
    # Ray gives its node a fixed 30 s to register (on a loaded machine `ray start` then gives up), and a port
    # picked free can be taken before Ray binds it: try again, on fresh ports.
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        proc, log, url = _start_head(temp_dir, head_options)
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
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """A head started with the README's `ray start` line."""
    with _running_head(tmp_path_factory, _try_it().head_options) as head:
        yield head


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("arctic_server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> pathlib.Path:
    """Shared by the jobs: the first builds the model, warm start and data, the second reuses them."""
    return tmp_path_factory.mktemp("ray_jobs")


def _submit_and_wait(cluster: Cluster, out_dir: pathlib.Path, *, server_url: str, package_mode: str, run_name: str,
                     submission_id: str, timeout_s: float = JOB_TIMEOUT_S):
    """The README's submit command against ``cluster``; returns the job's final status, info and logs."""
    from ray.job_submission import JobSubmissionClient

    _wait_for_job_api(cluster.dashboard_url, cluster.proc, cluster.log, 120)  # still answering (a loaded box)
    try_it = _try_it()
    env = _env()
    env.pop("RECIPE", None)
    env.update(try_it.submit_env)  # STEPS=2 and the server's URL, as the README has them ...
    # ... the URL of this test's server; the head's job API; where the outputs go; return once submitted
    env.update(ARCTIC_RL_URL=server_url, RAY_ADDRESS=cluster.dashboard_url, PACKAGE_MODE=package_mode,
               OUT_DIR=str(out_dir), RUN_NAME=run_name, SUBMISSION_ID=submission_id, NO_WAIT="1",
               PYTHON=sys.executable)
    proc = subprocess.run(["bash", SUBMIT, *try_it.submit_args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    client = JobSubmissionClient(cluster.dashboard_url)
    deadline = time.monotonic() + timeout_s
    status = client.get_job_status(submission_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(5)
        status = client.get_job_status(submission_id)
    logs = client.get_job_logs(submission_id)
    (out_dir / f"{submission_id}.log").write_text(logs)
    if not status.is_terminal():
        client.stop_job(submission_id)
    return status, client.get_job_info(submission_id), logs


@pytest.mark.timeout(JOB_TIMEOUT_S + 300)
@pytest.mark.parametrize("package_mode", ["preinstalled", "pip"])
def test_submitted_grpo_job_succeeds(cluster: Cluster, server, out_dir: pathlib.Path, package_mode: str):
    from ray.job_submission import JobStatus

    submission_id = f"test_{package_mode}_{uuid.uuid4().hex[:8]}"
    run_name = f"ray_{package_mode}"
    status, info, logs = _submit_and_wait(cluster, out_dir, server_url=server.url, package_mode=package_mode,
                                          run_name=run_name, submission_id=submission_id)
    assert status == JobStatus.SUCCEEDED, f"{status}: {info.message}\n{logs[-6000:]}"

    run_dir = out_dir / "runs" / run_name
    for step in (1, 2):
        assert f"[remote_backend] step {step}/2 | reward" in logs, logs[-6000:]
    assert f"log:     {run_dir}/run.log" in logs  # the recipe's header; its full output went to that file
    assert "step:1 -" not in logs and "step:1 -" in (run_dir / "run.log").read_text()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.timeout(900)
def test_a_head_with_too_few_logical_cpus_is_refused_naming_ray_start(tmp_path_factory, out_dir: pathlib.Path):
    """The README's `ray start` line without its --num-cpus, as on a 2-core machine: the job fails as soon
    as verl joins the cluster, before it contacts the server (the URL here answers nothing), naming the
    `ray start` option and the number to give it -- not a key of the run's config."""
    from ray.job_submission import JobStatus

    options = [o for o in _try_it().head_options if not o.startswith("--num-cpus")] + ["--num-cpus=2"]
    with _running_head(tmp_path_factory, options) as small:
        status, info, logs = _submit_and_wait(small, out_dir, server_url=f"http://127.0.0.1:{free_port()}",
                                              package_mode="preinstalled", run_name="ray_small_head",
                                              submission_id=f"test_small_{uuid.uuid4().hex[:8]}", timeout_s=600)
    assert status == JobStatus.FAILED, f"{status}: {info.message}\n{logs[-6000:]}"
    errors = [line for line in logs.splitlines() if "RemoteBackendConfigError: ray start --num-cpus:" in line]
    assert errors, logs[-6000:]
    assert "2 of 2 logical CPUs free and this run needs 5" in errors[-1]
    assert "`ray start --head --num-cpus=5`" in errors[-1] and "ray_kwargs" not in errors[-1]
    assert "cannot reach the server" not in logs  # refused before the backend was created
