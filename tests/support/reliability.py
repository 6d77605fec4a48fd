"""Fault injection for the reliability tests: a response-dropping TCP proxy and a restart supervisor.

* :class:`DropProxy` -- a small HTTP-aware TCP proxy on 127.0.0.1 (one thread per connection). It
  forwards each request to the upstream server and relays the answer, except for the calls a rule
  names: ``drop_response`` forwards the request, reads the server's whole answer, then closes the
  client's connection without a byte of it (the server *applied* the call; the client cannot
  know); ``drop_request`` closes the client's connection without forwarding anything (the call was
  *not* applied; the client cannot know either). It records every request's method, path and
  headers.
* :class:`Supervisor` -- what a process supervisor does: ``kill -9`` the reference server, then start
  it again on the same port and checkpoint root (in a thread, so the client sees it gone first).
* :func:`client_config` -- a verl main config for :class:`ArcticRLClient` against a given URL.

Nothing here is a stand-in for a component: the server is the real ``python -m arctic_rl.server``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from tests.support.arctic import grpo_batch, verl_main_config

N = 2  # rollout.n
MINI = 2  # ppo_mini_batch_size (prompts): 4 rows per optimizer step, 2 /forward-backward calls of 2 rows


# ------------------------------------------------------------------------------------------------ proxy


@dataclass
class Rule:
    method: str
    path: str  # without the query
    nth: int  # 1-based occurrence of (method, path) through the proxy
    action: str  # "drop_response" | "drop_request"
    #: called (e.g. kill -9 the server) before the request is forwarded (drop_request) or after the
    #: server's answer was read (drop_response); the client then gets no answer
    callback: Callable[[], None] | None = None


def _read_until(sock: socket.socket, buf: bytearray, marker: bytes) -> int:
    while True:
        at = buf.find(marker)
        if at >= 0:
            return at
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk


def _read_exact(sock: socket.socket, buf: bytearray, size: int) -> None:
    while len(buf) < size:
        chunk = sock.recv(max(65536, size - len(buf)))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk


def read_http_message(sock: socket.socket, buf: bytearray) -> tuple[bytes, dict[str, str], bytes]:
    """One HTTP/1.1 message (head, lower-cased headers, body) from ``sock``; ``buf`` keeps leftovers."""
    end = _read_until(sock, buf, b"\r\n\r\n")
    head = bytes(buf[: end + 4])
    del buf[: end + 4]
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            at = _read_until(sock, buf, b"\r\n")
            size = int(bytes(buf[:at]).split(b";")[0], 16)
            del buf[: at + 2]
            _read_exact(sock, buf, size + 2)
            body += buf[:size]
            del buf[: size + 2]
            if size == 0:
                break
        raw = head + b"".join([b"%x\r\n" % len(body), bytes(body), b"\r\n0\r\n\r\n"]) if body else head + b"0\r\n\r\n"
        return raw, headers, bytes(body)
    length = int(headers.get("content-length", "0") or 0)
    _read_exact(sock, buf, length)
    body = bytes(buf[:length])
    del buf[:length]
    return head + body, headers, body


class DropProxy:
    """See the module docstring. ``with DropProxy(upstream_port) as proxy: proxy.url``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.rules: list[Rule] = []
        self.seen: list[dict] = []
        self.counts: Counter[tuple[str, str]] = Counter()
        self.fired: list[Rule] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> DropProxy:  # noqa: PYI034 - Python 3.10 has no typing.Self
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._listener.close()

    def drop(self, method: str, path: str, nth: int, action: str = "drop_response",
             callback: Callable[[], None] | None = None) -> None:
        if action not in ("drop_response", "drop_request"):
            raise ValueError(f"action: expected drop_response or drop_request, got {action!r}")
        self.rules.append(Rule(method.upper(), path, nth, action, callback))

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _decide(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.counts[(method, path)] += 1
            n = self.counts[(method, path)]
            for rule in self.rules:
                if rule.method == method and rule.path == path and rule.nth == n:
                    self.fired.append(rule)
                    return rule
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while True:
                try:
                    raw, headers, _ = read_http_message(client, cbuf)
                except (ConnectionError, OSError):
                    return
                method, target = raw.split(b" ", 2)[:2]
                method, path = method.decode(), target.decode().split("?")[0]
                with self._lock:
                    self.seen.append({"method": method, "path": path, "headers": headers})
                rule = self._decide(method, path)
                if rule is not None and rule.action == "drop_request":
                    if rule.callback is not None:
                        rule.callback()
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=600)
                upstream.sendall(raw)
                answer, _, _ = read_http_message(upstream, ubuf)
                if rule is not None:  # drop_response
                    if rule.callback is not None:
                        rule.callback()
                    return
                client.sendall(answer)
        except (ConnectionError, OSError):
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()

    def mutating(self) -> list[dict]:
        return [s for s in self.seen if s["method"] == "POST"]


# ------------------------------------------------------------------------------------------------ supervisor


class Supervisor:
    """Kill -9 a :class:`tests.support.server.ServerProcess` and bring it back like a supervisor would."""

    def __init__(self, server, delay_s: float = 0.5) -> None:
        self.server = server
        self.delay_s = delay_s
        self.kills = 0
        self._threads: list[threading.Thread] = []

    def kill_and_restart(self) -> None:
        """SIGKILL now; start again (same port and checkpoint root) after ``delay_s``, in a thread."""
        self.server.stop(hard=True)
        self.kills += 1

        def bring_back():
            time.sleep(self.delay_s)
            self.server.start()

        t = threading.Thread(target=bring_back, daemon=True)
        t.start()
        self._threads.append(t)

    def wait(self, timeout: float = 300.0) -> None:
        for t in self._threads:
            t.join(timeout)


# ------------------------------------------------------------------------------------------------ runs


def client_config(model_dir, url: str | None, *, run_dir: str = "rel_run", kl_loss_coef: float | None = None,
                  **remote):
    """A verl main config for a tiny GRPO run of the adapter against ``url`` (fp32, fast retries; ``None``: a
    local server). ``remote``: sections of ``remote_backend`` whose keys replace these; ``kl_loss_coef``: verl's
    KL loss on, with that coefficient; ``run_dir``: ``trainer.default_local_dir``."""
    backend = {"server": {"url": url}, "train": {"deepspeed": {"bf16": False}, "seed": 7},
               "retry": {"backoff_initial_s": 0.05, "backoff_max_s": 0.5}}
    for section, values in remote.items():
        backend.setdefault(section, {}).update(values)
    actor = {"ppo_mini_batch_size": MINI, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1, "optim": {"lr": 5e-3},
             "use_kl_loss": kl_loss_coef is not None, "shuffle": False}
    if kl_loss_coef is not None:
        actor["kl_loss_coef"] = kl_loss_coef
    return verl_main_config({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 8},
        "trainer": {"default_local_dir": run_dir},
        "actor_rollout_ref": {"rollout": {"n": N, "temperature": 1.0}, "actor": actor},
        "remote_backend": backend,
    }, model_path=str(model_dir))


def train_batch(seed: int):
    """8 rows (4 prompts x n=2) in verl's layout, with fixed old log-probs and advantages."""
    _, _, data = grpo_batch(seed, interleave=False)
    tu.assign_non_tensor(data, global_batch_size=MINI * N, mini_batch_size=MINI * N, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=False, temperature=1.0)
    return data


def probe_batch():
    data = train_batch(99)
    return data


def final_logprobs(client) -> torch.Tensor:
    """The trained policy's log-probs of a fixed batch (dense ``[B, R]``, masked)."""
    data = probe_batch()
    out = no_padding_2_padding(client.compute_log_prob(data)["log_probs"], data)
    return out * data["response_mask"]


@dataclass
class RunResult:
    logprobs: torch.Tensor
    step: int
    stats: dict = field(default_factory=dict)
