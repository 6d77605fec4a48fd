"""``python -m verl.remote_backend.main_ppo <stock verl overrides> remote_backend=arctic``.

The same command line as verl's ``python -m verl.trainer.main_ppo`` (a GRPO recipe's override
arrays work unchanged), plus ``remote_backend=<name>``; no plugin variable, no ``+``. Steps:

0. check the backend's name and its ``remote_backend.*`` keys (``command_line``): a typo fails
   here, in one line, naming the closest valid name or key; after composition, every missing
   setting and every value verl cannot convert are listed in one line, and an unreachable
   ``remote_backend.server.url`` is one line too (``preflight``), before anything starts;
1. rewrite the overrides: settings a remote-backend run needs (``settings.forced_settings``)
   replace the recipe's values, each replacement reported on stderr;
2. compose ``remote_backend_ppo_trainer`` (verl's ``ppo_trainer`` + the backend's option group);
3. size Ray's logical CPUs for a local run (on a running cluster: check that it has them, naming
   ``ray start --num-cpus`` when it has not), validate with verl's own ``validate_config``;
4. create the backend once, in this process (a local reference server is our child; on a running
   cluster after joining it and checking its CPUs), write its handle into the config, run verl's V1
   (or, with ``trainer.use_v1=False``, legacy) trainer through Ray, and destroy the backend at the
   end -- also on failure, Ctrl-C, SIGTERM and SIGHUP (see :func:`start_ray` for the two Ray
   start-up details this needs).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from verl.remote_backend.command_line import check_command_line, exit_on_usage_error
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.logs import module_logger
from verl.remote_backend.preflight import PreflightError, check_server_reachable, check_settings
from verl.remote_backend.settings import check_cluster_cpus, ensure_ray_cpus, joins_running_cluster, rewrite_overrides

__all__ = ["CONFIG_DIR", "CONFIG_NAME", "main", "register_searchpath_plugin", "run", "start_ray"]

logger = module_logger(__name__)

CONFIG_DIR = str(Path(__file__).resolve().parent / "config")
CONFIG_NAME = "remote_backend_ppo_trainer"
_PLUGIN = "hydra_plugins.verl_remote_backend_searchpath"
#: Ray gives its local node a fixed 30 s to start; on a loaded machine that is not always enough
RAY_START_ATTEMPTS = 3
_RAY_START_TIMEOUT = "timed out during startup"


def register_searchpath_plugin() -> None:
    """Register our Hydra search-path plugin explicitly (Hydra also discovers it when installed;
    registering twice is harmless). Falls back to the file next to this package's root."""
    from hydra.core.plugins import Plugins

    try:
        module = importlib.import_module(_PLUGIN)
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        path = root / "hydra_plugins" / "verl_remote_backend_searchpath" / "__init__.py"
        spec = importlib.util.spec_from_file_location(_PLUGIN, path)
        if spec is None or spec.loader is None or not path.exists():
            raise
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    Plugins.instance().register(module.VerlRemoteBackendSearchPathPlugin)


def _has_accelerator() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def run(config: DictConfig) -> None:
    """Run verl's trainer on the backend selected in ``config`` (a composed main config)."""
    from verl.remote_backend.lifecycle import backend_name

    backend_name(config)  # no backend selected: that is the error to report, before any setting it would need
    check_settings(config)
    cluster = joins_running_cluster(config)
    if not cluster:  # on a running cluster its CPUs are checked first (below)
        check_server_reachable(config)
    import ray
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from verl.remote_backend.lifecycle import BackendOwner, resolve_total_training_steps, signals_raise
    from verl.remote_backend.trainer import (
        RemoteBackendTaskRunnerV0,
        RemoteBackendTaskRunnerV1,
        prepare_remote_backend_config,
    )

    auto_set_device(config)
    prepare_remote_backend_config(config)
    note = ensure_ray_cpus(config)
    if note:
        print(f"[remote_backend] {note}", file=sys.stderr)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    resolve_total_training_steps(config)
    runner = RemoteBackendTaskRunnerV1 if config.trainer.use_v1 else RemoteBackendTaskRunnerV0
    with signals_raise():
        try:
            if cluster:  # its CPUs are what `ray start` gave it: refuse before creating anything on the server
                start_ray(config)
                _check_cluster_cpus(config)
                check_server_reachable(config)
            with BackendOwner.create(config):
                try:
                    if not cluster:
                        start_ray(config)
                    run_ppo(config, task_runner_class=runner)
                finally:
                    if ray.is_initialized():
                        ray.shutdown()  # stop the workers before the backend they talk to goes away
        finally:
            if ray.is_initialized():
                ray.shutdown()  # the cluster check failed, or the backend could not be created


def _check_cluster_cpus(config: DictConfig) -> None:
    import ray

    total, free = ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0)
    check_cluster_cpus(config, total=total, free=free)


class _NoTask:
    @staticmethod
    def remote(config: DictConfig):
        import ray

        return ray.put(None)


class _StartRayOnly:
    """Stands in for a task runner class so that verl's ``run_ppo`` performs exactly its own Ray
    start-up (environment variables, runtime env, ``ray.init``) and returns at once."""

    run = _NoTask

    @classmethod
    def remote(cls) -> type[_StartRayOnly]:
        return cls

    @classmethod
    def options(cls, **kwargs) -> type[_StartRayOnly]:
        return cls


def start_ray(config: DictConfig) -> None:
    """Start Ray the way verl's ``run_ppo`` does, with two fixes for this process:

    * Ray gives its local node a fixed 30 s to come up; on a loaded machine that fails now and
      then, so the start is retried (``RAY_START_ATTEMPTS``);
    * Ray's native failure-signal handler takes SIGTERM over and kills the process right after the
      Python handler ran, before any ``finally``; the Python handlers are put back on top.
    """
    import ray
    from verl.trainer.main_ppo import run_ppo

    from verl.remote_backend.lifecycle import restore_python_signal_handlers

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            run_ppo(config, task_runner_class=_StartRayOnly)
            break
        except Exception as exc:  # only Ray's own start-up timeout is retried (the rest re-raises)
            if ray.is_initialized() or _RAY_START_TIMEOUT not in str(exc) or attempt == RAY_START_ATTEMPTS:
                raise
            print(f"[remote_backend] Ray did not start ({exc}); retrying ({attempt}/{RAY_START_ATTEMPTS})", file=sys.stderr)
            ray.shutdown()
    restore_python_signal_handlers()


@hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base=None)
def _hydra_main(config: DictConfig) -> None:
    try:
        run(config)
    except PreflightError as exc:  # a setting to change: one line, not Hydra's traceback
        exit_on_usage_error(exc)


class _DropCpuOnlyPlatformWarnings(logging.Filter):
    """verl's platform probe warns, in every process, that no GPU is there: on a remote-backend driver
    that owns no GPU by design, that is no news."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("No supported accelerator detected" in message or "is registered but not available" in message)


def _quiet_start_up() -> None:
    """Leave out verl's start-up notes that do not concern a remote-backend run: the optional training
    engines it lacks (torchtitan, veomni, ...) and, without a GPU, its platform probe's warnings."""
    warnings.filterwarnings("ignore", message=r"\w+ engine is not available", category=UserWarning)
    if not _has_accelerator():
        logging.getLogger("verl.plugin.platform.platform_manager").addFilter(_DropCpuOnlyPlatformWarnings())


def main(argv: list[str] | None = None) -> None:
    """Console entry: check the backend's name and keys, rewrite the overrides (step 1), then hand
    over to Hydra. A typo ends the process at once with one line on stderr (exit status 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        check_command_line(args)
    except RemoteBackendConfigError as exc:
        exit_on_usage_error(exc)
    _quiet_start_up()
    args, notes = rewrite_overrides(args, has_accelerator=_has_accelerator())
    for note in notes:
        print(f"[remote_backend] {note}", file=sys.stderr)
    register_searchpath_plugin()
    sys.argv = [sys.argv[0], *args]
    _hydra_main()


if __name__ == "__main__":
    main()
