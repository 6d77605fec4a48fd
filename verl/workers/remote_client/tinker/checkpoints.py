"""Where verl's resume finds a Tinker checkpoint: a step -> ``tinker://`` state path index.

``save_state`` names a checkpoint by a path that embeds the training run's id, and a resumed
run is a new training run, so the path of global step ``N`` cannot be derived; it is recorded.
:class:`StateIndex` keeps ``tinker_state_index.json`` (``{"<step>": "<path>"}``) in verl's
checkpoint folder (``trainer.default_local_dir`` unless ``remote_backend.checkpoint.index_dir``),
written atomically by the process that saves, read by the one that loads.
"""

from __future__ import annotations

import json
import os
import threading

from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = ["INDEX_FILE", "StateIndex"]

INDEX_FILE = "tinker_state_index.json"


class StateIndex:
    """The index file in ``directory`` (``None``: saving works, resuming by step does not)."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._lock = threading.Lock()

    @property
    def path(self) -> str | None:
        return None if self.directory is None else os.path.join(self.directory, INDEX_FILE)

    def read(self) -> dict[int, str]:
        if self.path is None or not os.path.exists(self.path):
            return {}
        with open(self.path, encoding="utf-8") as f:
            return {int(k): str(v) for k, v in json.load(f).items()}

    def record(self, step: int, state_path: str) -> None:
        if self.path is None:
            return
        with self._lock:
            entries = self.read()
            entries[int(step)] = state_path
            os.makedirs(self.directory, exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({str(k): v for k, v in sorted(entries.items())}, f, indent=2)
            os.replace(tmp, self.path)

    def lookup(self, step: int | None) -> str:
        entries = self.read()
        if step is None:
            if not entries:
                raise RemoteBackendConfigError("remote_backend.checkpoint.index_dir", "no Tinker checkpoint recorded",
                                               allowed=f"a folder holding {INDEX_FILE}", received=self.directory)
            step = max(entries)
        if step not in entries:
            raise RemoteBackendConfigError(
                "remote_backend.checkpoint.index_dir", f"no Tinker state recorded for global step {step}",
                allowed=sorted(entries) or f"a folder holding {INDEX_FILE}", received=self.directory)
        return entries[step]
