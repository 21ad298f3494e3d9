#!/usr/bin/env bash
# Submit a recipe to a running Ray cluster with `ray job submit`.
#
#   RAY_ADDRESS=http://HEAD:8265 RECIPE=recipes/math/run_gspo.sh bash recipes/cluster/ray_submit.sh [overrides]
#
# The recipe's environment knobs (MODEL_PATH, DATA_DIR, NNODES, N_GPUS_PER_NODE, LOSS, ...) are read
# HERE, on the submitting machine, and baked into the entrypoint `python3 -m maspo_verl.main ...`;
# paths (DATA_DIR, MODEL_PATH, CKPT_DIR) must therefore be valid on the cluster nodes.
# The runtime env uploads WORKING_DIR (this checkout, minus EXCLUDES) and pip-installs it with the
# extras in PIP_EXTRAS on every node, so verl's Ray workers import our losses and reward.
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
RECIPE=${RECIPE:-recipes/math/run_gspo.sh}
WORKING_DIR=${WORKING_DIR:-$REPO}
PIP_EXTRAS=${PIP_EXTRAS:-math}
# What each node pip-installs; the default is the uploaded working dir itself (Ray substitutes the
# variable on the node). PIP_SPEC='/shared/wheels/maspo_verl-0.1.0-py3-none-any.whl[math]' installs a
# wheel built with `pip wheel --no-deps . -w dist` instead (at a path every node can read);
# PIP_SPEC= (empty) installs nothing (the nodes' Python already has the package, e.g. the docker image).
# shellcheck disable=SC2016  # the variable is expanded by Ray on each node, not here
PIP_SPEC=${PIP_SPEC-'${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}'"[$PIP_EXTRAS]"}
# not uploaded (gitignore-style patterns): git data, every venv (.venv, .venv-verl090, ...), data and outputs
EXCLUDES=${EXCLUDES:-.git,.venv*,data,checkpoints,outputs,wandb,dist,build,*.egg-info,__pycache__}
SUBMISSION_ID=${SUBMISSION_ID:-}
NO_WAIT=${NO_WAIT:-0}

# Token authentication (Ray >= 2.52): Ray 2.60's `ray start` turns it on once a token exists, but the job CLI
# only sends the token with RAY_AUTH_MODE=token: do what `ray start` does.
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
    export RAY_AUTH_MODE=token
fi

# The entrypoint: the recipe's own command line, with the cluster's python3, as separate words.
# Ray's CLI shell-quotes each word (shlex.join) and runs the line in a shell on the head node, so
# the words must not be pre-quoted into one.
argv_file=$(mktemp)
trap 'rm -f "$argv_file"' EXIT
(cd "$REPO" && PYTHON=python3 PRINT_ARGV=1 bash "$RECIPE" "$@") >"$argv_file"
mapfile -d '' -t ENTRYPOINT <"$argv_file"
rm -f "$argv_file"  # here: the `exec` below ends this shell without running its EXIT trap

# Variables for the job (driver and every worker). Nothing verl or the local mode sets itself
# (TOKENIZERS_PARALLELISM, NCCL_DEBUG, ...): Ray refuses a driver's ray.init naming a job's variable.
RUNTIME_ENV=$(PIP_SPEC="$PIP_SPEC" EXCLUDES="$EXCLUDES" WORKING_DIR="$WORKING_DIR" python3 -c '
import json, os
env = {key: os.environ[key] for key in ("WANDB_MODE", "WANDB_ENTITY", "HF_HOME", "HF_HUB_OFFLINE") if key in os.environ}
env["HYDRA_FULL_ERROR"] = "1"
runtime_env = {"working_dir": os.environ["WORKING_DIR"], "excludes": os.environ["EXCLUDES"].split(",")}
if os.environ["PIP_SPEC"]:
    runtime_env["pip"] = [os.environ["PIP_SPEC"]]
runtime_env["env_vars"] = env
print(json.dumps(runtime_env))')

cmd=(ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$RUNTIME_ENV")
[ -n "$SUBMISSION_ID" ] && cmd+=(--submission-id "$SUBMISSION_ID")
[ "$NO_WAIT" = 1 ] && cmd+=(--no-wait)
cmd+=(-- "${ENTRYPOINT[@]}")

if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "DRY_RUN=1: would run:"
    printf "%q " "${cmd[@]}"; printf "\n"
    printf "entrypoint:"; printf " %q" "${ENTRYPOINT[@]}"; printf "\n"
    echo "runtime_env: $RUNTIME_ENV"
    exit 0
fi
if ! command -v ray >/dev/null 2>&1; then
    echo "error: no \`ray\` on PATH: activate the project venv (source .venv/bin/activate, after bash .ci/setup)" \
        "or install ray (it comes with verl)" >&2
    exit 1
fi
exec "${cmd[@]}"
