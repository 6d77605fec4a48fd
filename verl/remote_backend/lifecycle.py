"""The driver's one backend: created once, handed to every Ray actor, destroyed exactly once.

:class:`BackendOwner` creates the backend from verl's main config
(``RemoteBackendRegistry.create``), writes its handle into the config for the workers and
replicas (:mod:`verl.remote_backend.context`) and destroys it when the run ends, fails, or is
interrupted: use it as a context manager, and :func:`signals_raise` turns SIGTERM/SIGHUP into an
exception so that the ``finally`` runs for them too (Ctrl-C already raises KeyboardInterrupt).
While the jobs are being destroyed, one more Ctrl-C/SIGTERM/SIGHUP is logged and ignored
(:func:`signals_shielded`); a second one ends the process.

Which process owns the backend: ``python -m verl.remote_backend.main_ppo`` creates it in the
launching process (so a local reference server is that process's child, and Ctrl-C cleans up);
on the plugin route (stock ``main_ppo``) the trainer creates it inside Ray's task runner.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from omegaconf import DictConfig, OmegaConf, open_dict

from verl.remote_backend.base import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend.context import ensure_backends_registered, install_context
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.logs import module_logger

__all__ = [
    "BackendOwner",
    "backend_name",
    "resolve_total_training_steps",
    "restore_python_signal_handlers",
    "signals_raise",
    "signals_shielded",
]

logger = module_logger(__name__)


def backend_name(config: DictConfig) -> str:
    """``config.remote_backend.name``; raises naming the registered backends when absent."""
    node = config.get("remote_backend") if isinstance(config, DictConfig) else None
    name = node.get("name") if node is not None else None
    if not name:
        ensure_backends_registered()
        raise RemoteBackendConfigError(
            "remote_backend",
            "no remote backend selected: add `remote_backend=<name>` to the command line "
            "(`+remote_backend=<name>` with stock verl.trainer.main_ppo)",
            allowed=RemoteBackendRegistry.list(),
            received=None if node is None else OmegaConf.to_container(node),
        )
    return str(name)


def resolve_total_training_steps(config: DictConfig) -> int:
    """The optimizer-step horizon verl's trainer will compute, set into the config now.

    verl writes ``actor_rollout_ref.actor.optim.total_training_steps`` only after it built the
    data loader (inside Ray); a backend created before that needs it for warm-up ratios and
    cosine schedules. Same rule as verl's trainer: ``trainer.total_training_steps`` if set, else
    ``len(train_dataset) // data.train_batch_size * trainer.total_epochs``.
    """
    total = config.trainer.get("total_training_steps")
    if total is None:
        from verl.trainer.ppo.utils import create_rl_dataset
        from verl.utils.config import omega_conf_to_dataclass

        model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        dataset = create_rl_dataset(
            config.data.train_files,
            config.data,
            model_config.tokenizer,
            model_config.processor,
            is_train=True,
            max_samples=config.data.get("train_max_samples", -1),
        )
        total = len(dataset) // config.data.train_batch_size * config.trainer.total_epochs
    total = int(total)
    with open_dict(config):
        if OmegaConf.select(config, "actor_rollout_ref.actor.optim") is not None:
            config.actor_rollout_ref.actor.optim.total_training_steps = total
    return total


class BackendOwner:
    """Owns one backend created from verl's main config (see the module docstring)."""

    def __init__(self, name: str, backend: RemoteBackend):
        self.name = name
        self.backend = backend
        self._destroyed = False
        self._lock = threading.Lock()

    @classmethod
    def create(cls, config: DictConfig) -> BackendOwner:
        """Create the backend and write its context (name + handle) into ``config``."""
        name = backend_name(config)
        ensure_backends_registered()
        backend = RemoteBackendRegistry.create(name, config)
        owner = cls(name, backend)
        try:
            if not backend.requires_single_forwarder():
                logger.info("backend %r could use several forwarders; verl runs one", name)
            install_context(config, name=name, handle=backend.reconnect_handle())
        except BaseException:
            owner.destroy()
            raise
        logger.info("remote backend %r created", name)
        return owner

    def destroy(self) -> None:
        """Destroy the backend once; later calls do nothing. Errors are logged, not raised, so
        that they never hide the exception that ended the run."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
        try:
            with signals_shielded(f"destroying the jobs of remote backend {self.name!r}"):
                self.backend.destroy()
            logger.info("remote backend %r destroyed", self.name)
        except Exception as exc:  # noqa: BLE001
            logger.error("destroying remote backend %r failed: %s", self.name, exc)

    def __enter__(self) -> BackendOwner:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()


class _Terminated(SystemExit):
    pass


@contextlib.contextmanager
def _handled_by(handler: Callable[[int, FrameType | None], None], signals: tuple[int, ...]) -> Iterator[None]:
    """Within the block, ``handler`` handles ``signals``; the previous handlers come back afterwards.
    A no-op outside the main thread, where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)  # None: a handler not set from Python


def signals_raise(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> contextlib.AbstractContextManager:
    """Within the block, the given signals raise ``SystemExit(128 + signum)`` in the main thread
    (so ``finally`` clauses run); the previous handlers come back afterwards. A no-op outside
    the main thread, where Python cannot install handlers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(128 + signum)

    return _handled_by(handler, signals)


def signals_shielded(what: str, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
                     ) -> contextlib.AbstractContextManager:
    """Within the block, the first of ``signals`` is logged and ignored; a second one acts as usual.

    A user who presses Ctrl-C twice (or a supervisor that sends SIGTERM after SIGINT) would
    otherwise cut the clean-up short and leave the run's jobs on the server. The second signal
    still ends the process, for a clean-up that hangs. The previous handlers come back afterwards.
    A no-op outside the main thread, where Python cannot install handlers.
    """
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        if len(seen) == 1:
            logger.warning("%s received while %s; waiting for it to finish (send it again to abandon it)",
                           signal.Signals(signum).name, what)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Terminated(128 + signum)

    # a signal the process ignores (SIGINT of a job started in the background) stays ignored
    return _handled_by(handler, tuple(sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN))


def restore_python_signal_handlers(signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Put the Python-level handlers of ``signals`` back in charge at the C level.

    ``ray.init`` installs a native failure-signal handler for SIGTERM in the driver that terminates
    the process right after Python's handler merely *flagged* the signal, so no ``finally`` runs.
    Re-registering the handler Python already knows replaces the native one. Main thread only.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signals:
        handler = signal.getsignal(sig)
        if callable(handler):
            signal.signal(sig, handler)
