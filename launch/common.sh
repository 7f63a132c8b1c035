# shellcheck shell=bash
# Shared by the launchers in this folder (sourced, not run). Bash 4+.
# shellcheck disable=SC2034  # the variables set here are read by the launchers that source this file
#
# Parses:  [LAUNCHER OPTIONS] CONFIG [QKVFLOW OVERRIDES ...]
# Sets:    CONFIG, RUN_ID, LOG_DIR, DRY_RUN, PYTHON, OVERRIDES (array), and whatever the launcher's
#          own option handler (a function named launcher_option) consumes.

PYTHON=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-logs}
DRY_RUN=${DRY_RUN:-0}
RUN_ID=${RUN_ID:-}
CONFIG=
OVERRIDES=()

die_usage() {
    echo "$(basename "$0"): error: $1" >&2
    echo >&2
    usage >&2
    exit 2
}

# parse_args "$@": common options, the launcher's options (launcher_option NAME VALUE -> number of
# arguments it consumed, 0 if unknown), then the config, then the overrides passed to `qkvflow train`.
parse_args() {
    while [ $# -gt 0 ]; do
        case "$1" in
            -h|--help) usage; exit 0 ;;
            --dry-run) DRY_RUN=1; shift ;;
            --run-id) [ $# -ge 2 ] || die_usage "--run-id needs a value"; RUN_ID=$2; shift 2 ;;
            --run-id=*) RUN_ID=${1#*=}; shift ;;
            --log-dir) [ $# -ge 2 ] || die_usage "--log-dir needs a value"; LOG_DIR=$2; shift 2 ;;
            --log-dir=*) LOG_DIR=${1#*=}; shift ;;
            --) shift; break ;;
            -*)
                local used=0
                if declare -F launcher_option > /dev/null; then
                    launcher_option "$@"
                    used=$LAUNCHER_USED
                fi
                if [ "$used" -eq 0 ]; then
                    case "$1" in
                        --*.*) die_usage "missing CONFIG before the qkvflow overrides ($1 ...)" ;;
                        *) die_usage "unknown option $1" ;;
                    esac
                fi
                shift "$used"
                ;;
            *) break ;;
        esac
    done
    [ $# -ge 1 ] || die_usage "missing CONFIG (the YAML file to train)"
    CONFIG=$1
    shift
    OVERRIDES=("$@")
    if [ -z "$RUN_ID" ]; then
        RUN_ID=$(basename "$CONFIG")
        RUN_ID=${RUN_ID%.*}
    fi
    case "$RUN_ID" in
        ""|*/*|*" "*) die_usage "run id '$RUN_ID' must be non-empty, without '/' or spaces" ;;
    esac
}

# The `qkvflow train` arguments before the overrides (without the interpreter), in TRAIN_ARGS.
# Launchers add their own flags, then "${OVERRIDES[@]}" last, so that the user's overrides win.
train_args() {
    TRAIN_ARGS=(-m qkvflow train --config_path "$CONFIG" --trainer.id "$RUN_ID")
}

# quote ARG: ARG as one shell word (single quotes where needed, like Python's shlex.quote).
quote() {
    if [[ "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

# print_cmd ARG...: one shell-quoted line, copy-pasteable.
print_cmd() {
    local out="" arg
    for arg in "$@"; do
        out+="$(quote "$arg") "
    done
    echo "${out% }"
}
