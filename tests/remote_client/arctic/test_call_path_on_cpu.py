"""Each of the Arctic client's calls goes down through our modules once: no module is passed twice on a call path.

The client's public calls (``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``, ``update_weights``,
``generate``, ``save_checkpoint``, ``load_checkpoint``) run against the real reference server (CPU, tiny Qwen3)
under :func:`sys.setprofile`. Whenever a function of ``verl.workers.remote_client`` or ``verl.remote_backend`` is
entered, the stack of our frames below it is a *call path*: its modules from the outermost down, consecutive frames
of one module collapsed into one stop. A path that passes a module, leaves it for another and comes back to it
(``session -> recovery -> session``: a callback, a late lambda, a result mapped by the callee with the caller's
function) fails, and the failure lists every such path with the function of each stop. ``update_actor`` runs with a
recovery checkpoint due after every optimizer step, so the schedule's save and job read are on its paths too.

The measured paths are printed (``-s``): the longest path of each call and the modules its paths pass.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import pytest

import verl.remote_backend.builtin  # noqa: F401  (registers the built-in backends)
from tests.support.arctic import grpo_batch, update_batch, verl_main_config
from verl.remote_backend import RemoteBackendRegistry

OURS = ("verl.workers.remote_client.", "verl.remote_backend.")
N = 2  # rollout.n
MINI = 2  # ppo_mini_batch_size (prompts): 4 rows per optimizer step, 2 steps per update of 8 rows

Stop = tuple[str, str]  # (module, function of its innermost frame on the path)


class CallPaths:
    """The call paths seen while :meth:`recording` (see the module docstring), one per distinct module sequence."""

    def __init__(self) -> None:
        self.paths: dict[tuple[str, ...], list[Stop]] = {}

    def _profile(self, frame, event, arg) -> None:
        if event != "call" or not frame.f_globals.get("__name__", "").startswith(OURS):
            return
        stops: list[Stop] = []
        f = frame
        while f is not None:
            module = f.f_globals.get("__name__", "")
            if module.startswith(OURS) and (not stops or stops[-1][0] != module):
                stops.append((module, f.f_code.co_name))
            f = f.f_back
        stops.reverse()
        self.paths.setdefault(tuple(m for m, _ in stops), stops)

    @contextlib.contextmanager
    def recording(self) -> Iterator[CallPaths]:
        before = sys.getprofile()
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(before)
            threading.setprofile(None)

    def doubling_back(self) -> list[list[Stop]]:
        """The paths on which a module comes back after another one."""
        return [stops for key, stops in self.paths.items() if len(set(key)) != len(key)]

    def modules(self) -> set[str]:
        return {m for key in self.paths for m in key}

    def longest(self) -> list[Stop]:
        return max(self.paths.values(), key=len)


def show(stops: list[Stop]) -> str:
    return " > ".join(f"{module.rsplit('.', 1)[-1]}.{function}" for module, function in stops)


@pytest.fixture(scope="module")
def client(reference_server, tiny_model_dir, tmp_path_factory):
    remote = {"server": {"url": reference_server.url}, "train": {"deepspeed": {"bf16": False}},
              "recovery": {"checkpoint_every_n_steps": 1, "watch_interval_s": 0}}
    cfg = verl_main_config({
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "max_response_length": 8},
        "trainer": {"default_local_dir": str(tmp_path_factory.mktemp("call_path_run"))},
        "actor_rollout_ref": {
            "rollout": {"n": N, "temperature": 1.0},
            "actor": {"ppo_mini_batch_size": MINI, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1,
                      "optim": {"lr": 5e-3}, "use_kl_loss": False, "shuffle": False},
        },
        "remote_backend": remote,
    }, model_path=str(tiny_model_dir))
    client = RemoteBackendRegistry.create("arctic", cfg)
    yield client
    client.destroy()


def _calls(client) -> dict:
    """Each public call of the client, ready to run (inputs prepared outside the recording)."""
    data = update_batch(client, temperature=1.0, mini_rows=MINI * N)
    _, _, probe = grpo_batch(seed=1)
    return {
        "compute_log_prob": lambda: client.compute_log_prob(probe),
        "compute_ref_log_prob": lambda: client.compute_ref_log_prob(probe),
        "update_actor": lambda: client.update_actor(data),
        "update_weights": client.update_weights,
        "generate": lambda: client.generate([[5, 6, 7], [8, 9]], {"n": 2, "max_tokens": 4, "temperature": 1.0}),
        "save_checkpoint": lambda: client.save_checkpoint(),
        "load_checkpoint": lambda: client.load_checkpoint(client.step),
    }


@pytest.mark.slow
def test_every_call_passes_each_client_module_at_most_once(client):
    failures = []
    for name, call in _calls(client).items():
        recorder = CallPaths()
        with recorder.recording():
            call()
        longest = recorder.longest()
        print(f"{name}: {len(recorder.paths)} paths through {len(recorder.modules())} modules; longest "
              f"({len(longest)} stops): {show(longest)}")
        failures += [f"{name}: {show(stops)}" for stops in recorder.doubling_back()]
        if name == "update_actor":
            assert client.reliability_stats()["recovery/checkpoints_saved"] == 2  # the schedule's paths ran
    assert not failures, "call paths that come back to a module:\n" + "\n".join(failures)


def test_the_recorder_finds_a_path_that_comes_back():
    """A -> B -> A is found; A -> B, A -> C (siblings) and A -> A (one stop) are not."""
    recorder = CallPaths()
    a = ("verl.remote_backend.a", "f")
    recorder.paths = {("a",): [a], ("a", "b"): [a, ("verl.remote_backend.b", "g")],
                      ("a", "c"): [a, ("verl.remote_backend.c", "h")]}
    assert recorder.doubling_back() == []
    recorder.paths[("a", "b", "a")] = [a, ("verl.remote_backend.b", "g"), ("verl.remote_backend.a", "cb")]
    assert [show(p) for p in recorder.doubling_back()] == ["a.f > b.g > a.cb"]

    fake_module = {"__name__": "verl.remote_backend.fake"}
    exec("def inner():\n    return 1\n\ndef outer():\n    return inner()\n", fake_module)  # noqa: S102
    live = CallPaths()
    with live.recording():
        fake_module["outer"]()
    assert [show(p) for p in live.paths.values()] == ["fake.outer"]  # two frames of one module: one stop
