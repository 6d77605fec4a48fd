"""Get a finished run's trained model back as a Hugging Face directory (the Arctic RL ``/save`` with ``export_hf``).

A run's jobs are destroyed when it ends; its checkpoints stay on the server (the reference server keeps them under
its ``--checkpoint-root``: for the example scripts ``<run dir>/server``). This script re-creates the run's jobs from
the run's own composed config -- Hydra's ``.hydra/config.yaml`` -- through the adapter (so the training job has the
run's model, DeepSpeed settings and checkpoint directory), loads the newest checkpoint (or ``--step``), saves it
again with ``export_hf`` and copies the Hugging Face directory (weights, config, tokenizer) to ``--out``. Then it
destroys the jobs, and stops the reference server if it started one (``remote_backend.server.url: null`` in the
run, and no ``--url``).

    python examples/common/export_hf.py outputs/reverse_text/runs/latest --out my_model     # an example's run
    python examples/common/export_hf.py outputs/2026-12-03/10-00-00 --out my_model --url http://gpu-box:7000

RUN is a run directory of the example scripts (it holds ``hydra/.hydra/config.yaml``), the Hydra output directory
of a ``python -m verl.remote_backend.main_ppo`` command (``.hydra/config.yaml``; relative paths in that config are
taken from the directory you run this in, as the run took them) or the ``config.yaml`` itself. Checkpoints exist
when the run saved some: verl's ``trainer.save_freq`` (and its last step), or the adapter's recovery checkpoints
(``remote_backend.recovery.checkpoint_every_n_steps``, every 10 steps by default). ``--out`` is written only when
the server's ``hf_path`` is readable here (a server on this machine); otherwise the path on the server is printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

_CONFIG_PLACES = ("hydra/.hydra/config.yaml", ".hydra/config.yaml", "config.yaml")


def find_config(run: str | Path) -> Path:
    """The composed config of ``run``: the file itself, or the first of ``_CONFIG_PLACES`` under the directory."""
    path = Path(run)
    if path.is_file():
        return path
    for place in _CONFIG_PLACES:
        if (path / place).is_file():
            return path / place
    raise SystemExit(f"[export_hf] RUN: no {' or '.join(_CONFIG_PLACES)} under {path} (expected a run directory of "
                     "the example scripts, a Hydra output directory or a config.yaml)")


def export(run: str | Path, out: str | Path, *, url: str | None = None, step: int | None = None) -> dict[str, Any]:
    """Re-create ``run``'s jobs, load its checkpoint, save it with ``export_hf`` and copy the result to ``out``."""
    from omegaconf import OmegaConf, open_dict

    from verl.remote_backend.lifecycle import BackendOwner, resolve_total_training_steps
    from verl.remote_backend.trainer import prepare_remote_backend_config

    config = OmegaConf.load(find_config(run))
    with open_dict(config):
        if url is not None:
            config.remote_backend.server.url = url
        config.remote_backend.recovery.checkpoint_every_n_steps = 0  # this session saves once, by hand
    prepare_remote_backend_config(config)
    resolve_total_training_steps(config)
    with BackendOwner.create(config) as owner:  # jobs destroyed (and a local server stopped) on the way out
        loaded = owner.backend.load_checkpoint(step, sync_weights=False)
        # saved beside the checkpoint it came from (a path on the server), never over it
        saved = owner.backend.save_checkpoint(loaded.get("global_step", step), path=f"{loaded['path']}/hf_export",
                                              export_hf=True)
    hf_path = saved.get("hf_path")
    result = {"global_step": loaded.get("global_step"), "checkpoint": loaded.get("path"), "hf_path": hf_path,
              "out": None}
    if hf_path and Path(hf_path).is_dir():
        shutil.copytree(hf_path, out, dirs_exist_ok=True)
        result["out"] = str(Path(out).resolve())
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="run directory, Hydra output directory or config.yaml of the finished run")
    p.add_argument("--out", required=True, help="directory for the Hugging Face model")
    p.add_argument("--url", default=None, help="the Arctic RL server holding the checkpoints (default: the run's)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    a = p.parse_args(argv)
    result = export(a.run, a.out, url=a.url, step=a.step)
    print(f"[export_hf] {json.dumps(result)}")
    if result["out"] is None:
        print(f"[export_hf] the server wrote {result['hf_path']} on its own machine: copy it from there", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
