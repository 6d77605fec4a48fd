"""The plugin hook: ``VERL_USE_EXTERNAL_MODULES=verl.remote_backend.register``.

``import verl`` imports the modules named in that variable in every process (the driver, the
Ray task runner and workers). Importing this one registers:

* the built-in backends, their Ray worker and rollout replica (``verl.remote_backend.builtin``);
* the verl V1 trainer mode ``remote_backend`` (``verl.remote_backend.trainer``), selected with
  ``trainer.v1.trainer_mode=remote_backend``.

With it, stock ``python -m verl.trainer.main_ppo +remote_backend=arctic
trainer.v1.trainer_mode=remote_backend actor_rollout_ref.rollout.name=arctic ...`` runs on the
remote backend; ``python -m verl.remote_backend.main_ppo ... remote_backend=arctic`` needs none of
this (it imports what it needs and derives those settings itself).

It also registers our Hydra search-path plugin (see below). Errors are not swallowed: a missing
adapter fails the import, loudly. In the process of a stock ``main_ppo`` command it checks the
command line before Hydra composes it: an unknown backend name or ``remote_backend.*`` key ends the
process with one line naming the closest match (``verl.remote_backend.command_line``).
"""

from __future__ import annotations

import verl.remote_backend.builtin
import verl.remote_backend.trainer  # noqa: F401  (@register_trainer("remote_backend"))
from verl.remote_backend.command_line import (
    check_command_line,
    exit_on_usage_error,
    is_stock_main_ppo,
    stock_main_ppo_overrides,
)
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.main_ppo import register_searchpath_plugin

# Hydra discovers hydra_plugins/verl_remote_backend_searchpath when installed; registering it here
# as well makes `--config-name remote_backend_ppo_trainer` and the option group resolve even where
# the `hydra_plugins` namespace is not importable (a source checkout). Registering twice is a no-op.
register_searchpath_plugin()

if is_stock_main_ppo():
    try:
        check_command_line(stock_main_ppo_overrides())
    except RemoteBackendConfigError as exc:
        exit_on_usage_error(exc)
