#!/usr/bin/env bash
# TPU VM pod slice: runs the same command on every worker (gcloud ... ssh --worker=all); jax
# detects the pod and its coordinator itself. Run from your workstation; the checkout (with its
# .venv) must exist at --repo_dir on every worker, and model_dir must be a directory every worker
# sees (a Filestore/NFS mount, or a bucket mounted with gcsfuse): t5r writes its config and metrics
# with plain file I/O, so gs:// URLs are not supported as model_dir.
#
#   launch/tpu_pod.sh --tpu my-v4-32 --zone us-central2-b [--project my-proj] [--repo_dir ~/t5-retrieval] \
#       -- train --model_dir=/mnt/shared/runs/taco --gin_file=models/t5_base.gin --gin_file=runs/taco.gin
#   launch/tpu_pod.sh --dry_run --tpu ... -- train ...    (print the gcloud command)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" launch/commands.py tpu "$@"
