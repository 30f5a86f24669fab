#!/usr/bin/env bash
# Local run: one process, or N processes on this machine joined over 127.0.0.1 (gloo on CPU).
#
#   launch/local.sh -- train --model_dir=/tmp/run --gin_file=models/t5_tiny.gin --gin_file=runs/demo.gin
#   launch/local.sh local --num_processes 2 -- train ...     (JAX_PLATFORMS=cpu for a CPU test)
#   launch/local.sh --dry_run -- train ...                   (print the commands)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "local" ]]; then set -- local "$@"; fi
exec "${PYTHON:-.venv/bin/python}" launch/commands.py "$@"
