#!/usr/bin/env bash
# The README's second command, and what CI runs (.ci/run reads it from the README): install this checkout with
# its test tools into ./.venv, lint, then every test on two workers. Extra arguments go to pytest.
#
#   bash scripts/test.sh                       # scripts/install.sh --test; ruff check .; pytest -n 2 --dist loadscope
#   bash scripts/test.sh -m "not slow"         # the fast lane (no server process, DeepSpeed engine, Ray or verl run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh --test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n 2 --dist loadscope "$@"
