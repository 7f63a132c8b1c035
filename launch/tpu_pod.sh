#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: run the same command on every worker of a TPU VM with
# `gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command ...`. JAX finds the other
# workers by itself (jax.distributed on TPU VMs needs no arguments). Each worker logs to
# LOG_DIR/RUN_ID/host-<worker>.log in REMOTE_DIR on that worker. See launch/README.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HERE/common.sh"

TPU_NAME=${TPU_NAME:-}
ZONE=${ZONE:-}
PROJECT=${PROJECT:-}
REMOTE_DIR=${REMOTE_DIR:-qkvflow}
SETUP=${SETUP:-}
DETACH=${DETACH:-0}
GCLOUD=${GCLOUD:-gcloud}

usage() {
    cat <<USAGE
usage: $(basename "$0") --tpu NAME --zone ZONE [OPTIONS] CONFIG [--dotted.key value ...]

Runs \`qkvflow train --config_path CONFIG --trainer.id RUN_ID [overrides]\` on all workers of the
TPU VM NAME, from REMOTE_DIR (a checkout with qkvflow installed, the same on every worker).
CONFIG is a path on the workers, relative to REMOTE_DIR. Run the same command again to resume;
checkpoint to a bucket (--trainer.checkpointer.base_path gs://...) so that every worker sees them.

options (environment variable in brackets):
  --tpu NAME         TPU VM name [TPU_NAME] (required)
  --zone ZONE        its zone [ZONE] (required)
  --project P        Google Cloud project [PROJECT]; default: gcloud's
  --remote-dir DIR   working folder on the workers [REMOTE_DIR]; default qkvflow (in \$HOME)
  --setup CMD        shell command run first on each worker, e.g. "source .venv/bin/activate" [SETUP]
  --detach           start in the background with nohup and return at once [DETACH=1]
  --run-id ID        run id, for resuming and output folders [RUN_ID]; default: CONFIG's file name
  --log-dir DIR      logs go to DIR/RUN_ID/host-<worker>.log on each worker [LOG_DIR]; default logs
  --dry-run          print the gcloud command instead of running it [DRY_RUN=1]
  -h, --help         this text
Interpreter on the workers: \$PYTHON (default python3). gcloud: \$GCLOUD (default gcloud).
USAGE
}

launcher_option() {
    LAUNCHER_USED=0
    case "$1" in
        --detach) DETACH=1; LAUNCHER_USED=1; return ;;
        --tpu|--zone|--project|--remote-dir|--setup)
            [ $# -ge 2 ] || die_usage "$1 needs a value"
            case "$1" in
                --tpu) TPU_NAME=$2 ;;
                --zone) ZONE=$2 ;;
                --project) PROJECT=$2 ;;
                --remote-dir) REMOTE_DIR=$2 ;;
                --setup) SETUP=$2 ;;
            esac
            LAUNCHER_USED=2 ;;
    esac
}

parse_args "$@"
[ -n "$TPU_NAME" ] || die_usage "missing --tpu NAME"
[ -n "$ZONE" ] || die_usage "missing --zone ZONE"

train_args
LOGS="$LOG_DIR/$RUN_ID"
TRAIN=$(print_cmd "$PYTHON" "${TRAIN_ARGS[@]}" "${OVERRIDES[@]}")
# the worker's index in the slice, from the TPU VM metadata server
# shellcheck disable=SC2016  # expanded on the worker, not here
WORKER='$(curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)'
LOG="$(quote "$LOGS")/host-$WORKER.log"
REMOTE="cd $(quote "$REMOTE_DIR") && mkdir -p $(quote "$LOGS")"
[ -z "$SETUP" ] || REMOTE+=" && $SETUP"
if [ "$DETACH" = 1 ]; then
    REMOTE+=" && (nohup $TRAIN > $LOG 2>&1 < /dev/null &)"
else
    REMOTE+=" && $TRAIN > $LOG 2>&1"
fi

CMD=("$GCLOUD" compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE")
[ -z "$PROJECT" ] || CMD+=(--project "$PROJECT")
CMD+=(--worker=all --command "$REMOTE")

if [ "$DRY_RUN" = 1 ]; then
    print_cmd "${CMD[@]}"
    exit 0
fi
echo "run $RUN_ID on all workers of $TPU_NAME; logs: $REMOTE_DIR/$LOGS/host-<worker>.log on each worker" >&2
exec "${CMD[@]}"
