#!/usr/bin/env bash
# Train on one machine with all its accelerators: one process (JAX sees every local GPU), or
# --processes N processes joined by jax.distributed over a loopback coordinator (the code path of a
# multi-host run). Logs: LOG_DIR/RUN_ID/host-<i>.log. See launch/README.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HERE/common.sh"

PROCESSES=${PROCESSES:-1}
PORT=${PORT:-}
CPU_DEVICES=${CPU_DEVICES:-}
GPUS=${GPUS:-}

usage() {
    cat <<USAGE
usage: $(basename "$0") [OPTIONS] CONFIG [--dotted.key value ...]

Runs \`qkvflow train --config_path CONFIG --trainer.id RUN_ID [overrides]\` on this machine.
Run the same command again to resume from the newest complete checkpoint of RUN_ID.

options (environment variable in brackets):
  --run-id ID        run id, for resuming and output folders [RUN_ID]; default: CONFIG's file name
  --processes N      processes on this machine, joined by jax.distributed [PROCESSES]; default 1,
                     which uses every local GPU from one process
  --port P           coordinator port on 127.0.0.1 when N > 1 [PORT]; default: a free port
  --gpus G           GPUs to split between the N processes [GPUS]; default: nvidia-smi's count
  --cpu-devices K    no accelerator: K simulated CPU devices per process, gloo collectives (testing)
                     [CPU_DEVICES]
  --log-dir DIR      logs go to DIR/RUN_ID/host-<i>.log [LOG_DIR]; default logs
  --dry-run          print the command lines instead of running them [DRY_RUN=1]
  -h, --help         this text
Interpreter: \$PYTHON (default python3), which must have qkvflow installed.
USAGE
}

launcher_option() {
    LAUNCHER_USED=0
    case "$1" in
        --processes|--port|--gpus|--cpu-devices)
            [ $# -ge 2 ] || die_usage "$1 needs a value"
            case "$1" in
                --processes) PROCESSES=$2 ;;
                --port) PORT=$2 ;;
                --gpus) GPUS=$2 ;;
                --cpu-devices) CPU_DEVICES=$2 ;;
            esac
            LAUNCHER_USED=2 ;;
    esac
}

parse_args "$@"
[[ "$PROCESSES" =~ ^[1-9][0-9]*$ ]] || die_usage "--processes must be a positive integer, got '$PROCESSES'"
[ -z "$CPU_DEVICES" ] || [[ "$CPU_DEVICES" =~ ^[1-9][0-9]*$ ]] || die_usage "--cpu-devices must be a positive integer"
[ "$DRY_RUN" = 1 ] || [ -f "$CONFIG" ] || die_usage "config file '$CONFIG' does not exist"

if [ "$PROCESSES" -gt 1 ] && [ -z "$PORT" ]; then
    PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

ENVS=()
if [ -n "$CPU_DEVICES" ]; then
    # the caller's XLA flags are kept (the device count is added after them, so it wins)
    ENVS+=(JAX_PLATFORMS=cpu "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$CPU_DEVICES"
           JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo)
elif [ "$PROCESSES" -gt 1 ] && [ -z "$GPUS" ]; then
    if [ "$DRY_RUN" = 1 ] && ! command -v nvidia-smi > /dev/null; then
        GPUS=$PROCESSES
    else
        GPUS=$(nvidia-smi -L | wc -l)
    fi
fi
if [ -n "$GPUS" ] && [ $((GPUS % PROCESSES)) -ne 0 ]; then
    die_usage "$GPUS GPUs cannot be split evenly between $PROCESSES processes"
fi

train_args
LOGS="$LOG_DIR/$RUN_ID"
PIDS=()

for ((i = 0; i < PROCESSES; i++)); do
    ARGS=("${TRAIN_ARGS[@]}")
    if [ "$PROCESSES" -gt 1 ]; then
        ARGS+=(--trainer.distributed.coordinator_address "127.0.0.1:$PORT"
               --trainer.distributed.num_processes "$PROCESSES"
               --trainer.distributed.process_id "$i")
        if [ -n "$GPUS" ] && [ -z "$CPU_DEVICES" ]; then
            per=$((GPUS / PROCESSES))
            ids=$(seq -s, $((i * per)) $((i * per + per - 1)))
            ARGS+=(--trainer.distributed.local_device_ids "[$ids]")
        fi
    fi
    ARGS+=("${OVERRIDES[@]}")  # last, so that they win
    LOG="$LOGS/host-$i.log"
    CMD=("$PYTHON" "${ARGS[@]}")
    [ ${#ENVS[@]} -eq 0 ] || CMD=(env "${ENVS[@]}" "${CMD[@]}")
    if [ "$DRY_RUN" = 1 ]; then
        echo "$(print_cmd "${CMD[@]}") > $(quote "$LOG") 2>&1"
        continue
    fi
    mkdir -p "$LOGS"
    "${CMD[@]}" > "$LOG" 2>&1 &
    PIDS+=($!)
    echo "process $i (pid $!): $LOG" >&2
done
[ "$DRY_RUN" = 1 ] && exit 0

# SIGTERM / SIGINT to this script: pass SIGTERM on (the trainers save a checkpoint and exit 0).
# shellcheck disable=SC2317,SC2329  # called by the trap
forward() { kill -TERM "${PIDS[@]}" 2> /dev/null || true; }
trap forward TERM INT

status=0
for pid in "${PIDS[@]}"; do
    while true; do
        set +e
        wait "$pid"
        rc=$?
        set -e
        # a trapped signal interrupts `wait` with status > 128 while the child still runs
        if [ "$rc" -gt 128 ] && kill -0 "$pid" 2> /dev/null; then continue; fi
        break
    done
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
done
echo "done (exit status $status); logs in $LOGS/" >&2
exit "$status"
