#!/usr/bin/env bash
# Runs one `qkvflow bench compare` study on the device machine under a deadline (benchmarks/README.md):
#   bash .device/on-device.sh bash benchmarks/device_compare.sh compare/STUDY.yaml [bench compare options]
# with `.device` and `cache` carried (the prepared corpora, and Tiny Shakespeare's source copied to
# cache/shared/data/tinyshakespeare/ so nothing is rebuilt there). Every run is its own process on the one
# GPU (`--jobs $JOBS`); at $BUDGET seconds the study gets SIGTERM. What has landed is packed under $OUT
# every $PACK_EVERY seconds (default 20: the workdir without checkpoints, GPU use and host load), since the
# machine and its disk go back when idle. Its own logs go to $STUDY_LOGS (default /tmp/study_logs).
set -u
study=${1:?usage: device_compare.sh compare/STUDY.yaml}
[ -f "benchmarks/$study" ] || { echo "device_compare.sh: benchmarks/$study is not a file; expected a study such as compare/depth_dial_impulse.yaml" >&2; exit 2; }
: "${OUT:?device_compare.sh: OUT is not set; expected the folder whose files come back from the device}"
budget=${BUDGET:-520}
jobs=${JOBS:-12}
every=${PACK_EVERY:-20}  # seconds between two packs of what has landed
t0=$(date +%s)
r=${STUDY_LOGS:-/tmp/study_logs}  # copied to $OUT by pack: logs kept under $OUT too would count twice against its 8 files
mkdir -p "$r" /tmp/jaxcache
for v in $(compgen -e | grep -E '^(SLURM_|OMPI_|PMI_|PMIX_|KUBERNETES_|MEGASCALE_|CLOUD_TPU|TPU_)'); do unset "$v"; done
QKVFLOW_SHARED_DIR="$(pwd)/cache/shared"
export QKVFLOW_SHARED_DIR JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.035 JAX_DEFAULT_MATMUL_PRECISION=float32
{
  nvidia-smi; nproc; python3 --version
  python3 -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())'
  date -u
} > "$r/env.txt" 2>&1
pack() {
  tar czf "$OUT/study.tgz" --exclude=checkpoints -C /tmp study 2>/dev/null
  cp "$r"/*.txt "$OUT/" 2>/dev/null
}
shift
setsid python3 -m qkvflow bench compare "benchmarks/$study" --workdir /tmp/study --jobs "$jobs" "$@" > "$r/study.txt" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  if [ $(( $(date +%s) - t0 )) -gt "$budget" ]; then
    echo "deadline: SIGTERM" >> "$r/status.txt"
    kill -TERM -- "-$pid"
    sleep 10
    break
  fi
  sleep "$every"
  {
    date -u +%T
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    uptime
    find /tmp/study/results -name '*.json' 2>/dev/null | wc -l
  } >> "$r/load.txt" 2>&1
  pack
done
wait "$pid"
echo "study rc=$? elapsed $(( $(date +%s) - t0 ))s" >> "$r/status.txt"
pack
cat "$r/status.txt"
tail -n 40 "$r/study.txt"
