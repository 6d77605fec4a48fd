"""Load on the reference server: 32 concurrent generation clients plus a training loop, for 60 s.

    python benchmarks/load.py                     # 32 clients, 60 s (the figures in docs/RELIABILITY.md)
    python benchmarks/load.py --clients 8 --seconds 15

One real ``python -m arctic_rl.server`` subprocess (CPU, one torch thread, started like the tests
start it: ``tests/support/server.py``) serves a tiny Qwen3. Here, on 127.0.0.1 only:

* ``--clients`` threads, each with its own ``ArcticRLClient`` attached to the run's jobs (as verl's
  rollout replicas are), call ``generate`` in a loop (2 prompts x 4-8 new tokens, seeded);
* one thread trains: ``compute_log_prob``, ``update_actor`` (2 optimizer steps of 2
  ``/forward-backward`` calls) and ``update_weights``, in a loop, through the run's own client;
* one thread times ``GET /health`` every 0.2 s, and one samples the server's RSS (``/proc``) every
  second.

It reports per-kind counts, errors and latency percentiles, and the RSS at start, peak and end;
``tests/arctic_rl/server/test_load_on_cpu.py`` runs a shorter version with assertions (no errors, ``/health``
responsive, RSS bounded). The machine is shared: figures are one run's, with the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' helpers (tests.support) from a checkout

import requests

from arctic_rl.tiny_models import build_tiny_model
from tests.support.reliability import client_config, train_batch
from tests.support.server import running_server

__all__ = ["percentile", "rss_mib", "run_load"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def run_load(model_dir: Path, url: str, server_pid: int, *, clients: int, seconds: float) -> dict[str, Any]:
    """Drive the server at ``url`` as the module docstring says; returns the measurements."""
    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

    owner = ArcticRLClient.from_config(client_config(model_dir, url, recovery={"checkpoint_every_n_steps": 0}))
    latencies: dict[str, list[float]] = defaultdict(list)
    errors: list[str] = []
    rss: list[tuple[float, float]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def record(kind: str, t0: float) -> None:
        with lock:
            latencies[kind].append(time.perf_counter() - t0)

    def fail(kind: str, exc: BaseException) -> None:
        with lock:
            errors.append(f"{kind}: {type(exc).__name__}: {str(exc)[:300]}")

    def generator(index: int) -> None:
        rng = random.Random(index)
        client = ArcticRLClient.from_config(client_config(model_dir, url), handle=owner.reconnect_handle())
        try:
            while not stop.is_set():
                prompts = [[rng.randrange(3, 90) for _ in range(rng.randrange(2, 12))] for _ in range(2)]
                t0 = time.perf_counter()
                try:
                    out = client.generate(prompts, {"max_tokens": rng.randrange(4, 9), "temperature": 1.0,
                                                    "seed": rng.randrange(1 << 30)})
                    if len(out) != len(prompts):
                        raise AssertionError(f"{len(out)} results for {len(prompts)} prompts")
                    record("generate", t0)
                except Exception as exc:  # noqa: BLE001 - counted, reported, asserted on
                    fail("generate", exc)
        finally:
            client.destroy()

    def trainer() -> None:
        step = 0
        while not stop.is_set():
            data = train_batch(step)
            for kind, call in (("compute_log_prob", owner.compute_log_prob), ("update_actor", owner.update_actor),
                               ("update_weights", lambda _d: owner.update_weights())):
                t0 = time.perf_counter()
                try:
                    call(data)
                    record(kind, t0)
                except Exception as exc:  # noqa: BLE001
                    fail(kind, exc)
            step += 1

    def health() -> None:
        session = requests.Session()
        while not stop.wait(0.2):
            t0 = time.perf_counter()
            try:
                if session.get(url + "/health", timeout=30).status_code != 200:
                    raise RuntimeError("not 200")
                record("health", t0)
            except Exception as exc:  # noqa: BLE001
                fail("health", exc)

    def memory() -> None:
        t_start = time.monotonic()
        while True:
            rss.append((time.monotonic() - t_start, rss_mib(server_pid)))
            if stop.wait(1.0):
                return

    threads = [threading.Thread(target=generator, args=(i,), daemon=True) for i in range(clients)]
    threads += [threading.Thread(target=f, daemon=True) for f in (trainer, health, memory)]
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        stop.wait(seconds)
    finally:
        stop.set()
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(300)
        drain = time.monotonic() - t0 - elapsed
        steps = owner.step
        owner.destroy()
    return {
        "seconds": elapsed,
        "drain_seconds": drain,
        "clients": clients,
        "latencies": dict(latencies),
        "errors": errors,
        "rss": rss,
        "optimizer_steps": steps,
        "loadavg": (load_start, os.getloadavg()[0]),
    }


def table(result: dict[str, Any]) -> str:
    rows = [f"{'call':<18}{'count':>7}{'per s':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"]
    for kind, values in sorted(result["latencies"].items()):
        ms = [v * 1000 for v in values]
        rows.append(f"{kind:<18}{len(ms):>7}{len(ms) / result['seconds']:>8.1f}{percentile(ms, 0.5):>10.1f}"
                    f"{percentile(ms, 0.99):>10.1f}{max(ms):>10.1f}")
    mem = [m for _, m in result["rss"]]
    rows.append(f"server RSS MiB: start {mem[0]:.0f}, peak {max(mem):.0f}, end {mem[-1]:.0f}")
    rows.append(f"errors: {len(result['errors'])}; optimizer steps: {result['optimizer_steps']}; "
                f"{result['clients']} generate clients for {result['seconds']:.0f} s (+{result['drain_seconds']:.0f} s "
                f"to finish the calls in flight); "
                f"load average {result['loadavg'][0]:.1f} -> {result['loadavg'][1]:.1f}")
    rows.extend(f"  {e}" for e in result["errors"][:10])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32, help="concurrent generation clients (default 32)")
    p.add_argument("--seconds", type=float, default=60.0, help="duration of the load (default 60)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="arctic_load_") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        with running_server(Path(tmp) / "server") as srv:
            result = run_load(model, srv.url, srv.proc.pid, clients=args.clients, seconds=args.seconds)
    print(table(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
