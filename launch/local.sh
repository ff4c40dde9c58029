#!/usr/bin/env bash
# Several training processes on this machine, joined through jax.distributed on loopback, each
# with its own CPU devices: the multi-host code path without a cluster.
#
#   launch/local.sh NUM_PROCESSES DEVICES_PER_PROCESS [train flags...]
#   launch/local.sh 2 4 --mock-data --tensor-model-parallel-size 4 --train-iters 10
#
# Process 0's output is printed here (without gloo's "[Gloo] Rank N is connected" announcements); every
# process's output is in $LOG_DIR/process_<i>.log. When one process fails, the others are
# stopped (SIGTERM, then SIGKILL after $GRACE_SECONDS: jax.distributed catches SIGTERM as a
# preemption notice, so it alone does not stop a process), the failed process's last lines are
# shown, and this script exits with its status. Ctrl-C stops them all.
#
# Environment:
#   PYTHON            interpreter (default: python)
#   LAUNCH_COMMAND    what each process runs (default: "$PYTHON -m mlm_jax.train"); the flags follow it
#   COORDINATOR_PORT  loopback port of the coordinator (default: a free one)
#   LOG_DIR           per-process logs (default: a new folder under ${TMPDIR:-/tmp})
#   GRACE_SECONDS     between SIGTERM and SIGKILL when stopping the others (default: 3)
# Each process gets MLM_JAX_COORDINATOR_ADDRESS, MLM_JAX_NUM_PROCESSES, MLM_JAX_PROCESS_ID,
# JAX_PLATFORMS=cpu and --xla_force_host_platform_device_count=DEVICES_PER_PROCESS in XLA_FLAGS
# (other XLA_FLAGS are kept).
set -u
if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501 )); then
    echo "$0: needs bash 5.1 or newer (wait -n -p); this is bash $BASH_VERSION" >&2
    exit 2
fi

if [[ $# -lt 2 || ! "$1" =~ ^[1-9][0-9]*$ || ! "$2" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NUM_PROCESSES DEVICES_PER_PROCESS [train flags...]" >&2
    exit 2
fi
num=$1
devices=$2
shift 2

PYTHON=${PYTHON:-python}
read -r -a command <<< "${LAUNCH_COMMAND:-$PYTHON -m mlm_jax.train}"
port=${COORDINATOR_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log_dir=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/mlm_jax_local.XXXXXX")}
grace=${GRACE_SECONDS:-3}
mkdir -p "$log_dir"
xla_flags="$(sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g' <<< "${XLA_FLAGS:-}") --xla_force_host_platform_device_count=$devices"

# gloo announces every communicator on stderr, from C++ (no setting silences it), from several
# threads at once (the pieces of its lines can interleave) and often in the middle of a line
# (after the progress bar's). Whole announcements are cut out wherever they are; a line left
# with pieces of one is dropped, unless it says `error:`.
gloo_msg='\[Gloo\] Rank [0-9]+ is connected to [0-9]+ peer ranks\. Expected number of connected peer ranks is : [0-9]+'
gloo_piece='\[Gloo\]|is connected to [0-9]* ?peer ranks|peer ranks\. Expected number|connected peer ranks is : '
strip_gloo() {
    sed -u -E -e "/^(${gloo_msg})+\$/d" -e "s/${gloo_msg}//g" -e '/error:/b' -e "/${gloo_piece}/d"
}
pids=()
stop_all() {
    local pid
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    local waited=0
    while (( waited < grace * 10 )); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        (( alive )) || break
        sleep 0.1
        waited=$((waited + 1))
    done
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
}
trap 'echo "launch/local.sh: interrupted; stopping all processes" >&2; stop_all; exit 130' INT TERM

echo "launch/local.sh: $num process(es) x $devices CPU device(s), coordinator 127.0.0.1:$port, logs in $log_dir" >&2
for ((i = 0; i < num; i++)); do
    log="$log_dir/process_$i.log"
    if (( i == 0 )); then
        # Process 0 goes to the terminal too; a process substitution keeps $! the python pid.
        env XLA_FLAGS="$xla_flags" JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 \
            MLM_JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" MLM_JAX_NUM_PROCESSES="$num" MLM_JAX_PROCESS_ID="$i" \
            "${command[@]}" "$@" > >(tee "$log" | strip_gloo) 2>&1 &
    else
        env XLA_FLAGS="$xla_flags" JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 \
            MLM_JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" MLM_JAX_NUM_PROCESSES="$num" MLM_JAX_PROCESS_ID="$i" \
            "${command[@]}" "$@" > "$log" 2>&1 &
    fi
    pids+=($!)
done

# Wait for all, in the order they end; the first failure stops the rest. (The order matters: a
# process whose peer died stops too, soon after, and must not be reported as the cause.)
declare -A index_of running
for ((i = 0; i < num; i++)); do index_of[${pids[$i]}]=$i; running[${pids[$i]}]=1; done
while (( ${#running[@]} > 0 )); do
    ended=""
    wait -n -p ended "${!running[@]}"
    status=$?
    [[ -n "$ended" ]] || continue  # a signal interrupted the wait
    unset "running[$ended]"
    i=${index_of[$ended]}
    if (( status != 0 )); then
        echo "launch/local.sh: process $i exited with status $status; stopping the others" >&2
        stop_all
        if (( i != 0 )); then
            echo "launch/local.sh: last lines of process $i ($log_dir/process_$i.log):" >&2
            strip_gloo < "$log_dir/process_$i.log" | tail -n 20 | sed "s/^/[process $i] /" >&2
        fi
        exit "$status"
    fi
done
wait  # the tee of process 0's output
exit 0
