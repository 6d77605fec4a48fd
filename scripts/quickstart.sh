#!/usr/bin/env bash
# The README's first command: install this checkout into ./.venv (scripts/install.sh), then run the reverse-text
# GRPO example (examples/grpo/run_reverse_text_grpo_arl_local.sh) with the venv's Python.
#
#   bash scripts/quickstart.sh                                          # install, then 40 GRPO steps on the CPU
#   STEPS=20 ZORRO=true bash scripts/quickstart.sh                      # the example's knobs, from the environment
#   bash scripts/quickstart.sh actor_rollout_ref.actor.optim.lr=5e-4    # arguments: the example's Hydra overrides
#
# Each run writes a directory of its own under outputs/reverse_text/runs/ (runs/latest points at the newest).
# Afterwards `source .venv/bin/activate` puts the venv on your PATH for the other examples.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
export PATH="${PWD}/.venv/bin:${PATH}" PYTHON="${PWD}/.venv/bin/python"
exec bash examples/grpo/run_reverse_text_grpo_arl_local.sh "$@"
