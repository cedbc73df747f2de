#!/usr/bin/env bash
# Starts one host's share of a two-host moe-fabric cluster and keeps it in the foreground.
#
#   once:    moe-fabric cluster-secret /etc/moe-fabric/secret   (then copy it to host B, mode 0600)
#   host A:  HOST_A=10.0.0.1 MODEL_DIR=/srv/models/m CLUSTER_SECRET_FILE=/etc/moe-fabric/secret ./two-hosts.sh a
#            orchestrator, gateway, one attention worker, one expert worker
#   host B:  HOST_A=10.0.0.1 HOST_B=10.0.0.2 MODEL_DIR=/srv/models/m CLUSTER_SECRET_FILE=/etc/moe-fabric/secret \
#            ./two-hosts.sh b
#            one attention worker, one expert worker
#
# Every internal connection proves the cluster secret; with TLS_CERT and TLS_KEY set (the same
# files on both hosts) every TCP link and HTTP server is encrypted too.
#
# Ctrl-C (or SIGTERM) stops every process this script started. The orchestrator and the gateway are
# started again whenever they exit (a supervisor's job: the workers keep serving meanwhile and
# register with the new orchestrator); a worker that exits is the fabric's to handle. See deploy/README.md.
set -euo pipefail

usage() {
    cat >&2 <<'EOF'
usage: two-hosts.sh a|b

required environment:
  MODEL_DIR      checkpoint directory on this host (must contain config.json)
  HOST_A         address of host A that host B can reach (orchestrator, A's workers)
  HOST_B         address of host B that host A can reach (role b only)
  CLUSTER_SECRET_FILE  the cluster secret (mode 0600, the same file on both hosts): every internal
                 port refuses peers that cannot prove it

optional environment (defaults shown):
  ORCH_PORT=7000  GATEWAY_PORT=8000  AW_PORT=7100  EW_PORT=7200
  ORCH_BIND=$HOST_A  GATEWAY_BIND=$HOST_A   (role a: where the HTTP servers listen)
  TLS_CERT= TLS_KEY=   (the cluster certificate and key: TLS on every TCP link and HTTP server)
  TRANSPORT=tcp (tcp|ucx)  DTYPE= (float32|bfloat16; empty = the checkpoint's)
  THREADS=1  GATHER=sync (sync|threshold)  ORCH_WAIT=60  MOE_FABRIC=moe-fabric
EOF
    exit 2
}

die() {
    echo "two-hosts.sh: $*" >&2
    exit 2
}

require() {  # require NAME WHY
    [[ -n "${!1:-}" ]] || die "$1 is not set: $2"
}

check_port() {
    [[ "${!1}" =~ ^[0-9]+$ ]] && ((10#${!1} >= 1 && 10#${!1} <= 65535)) || die "$1 must be a port in 1..65535, got '${!1}'"
}

check_advertised() {  # a worker's --host is also the address peers dial
    case "${!1}" in
        0.0.0.0 | :: | "[::]") die "$1=${!1} cannot be dialled by peers; use this host's reachable address" ;;
    esac
}

[[ $# -eq 1 ]] || usage
ROLE=$1
[[ "$ROLE" == a || "$ROLE" == b ]] || usage

require MODEL_DIR "set it to the checkpoint directory (the same model must exist on both hosts)"
[[ -f "$MODEL_DIR/config.json" ]] || die "MODEL_DIR=$MODEL_DIR has no config.json"
require HOST_A "set it to host A's address (the orchestrator's), e.g. HOST_A=10.0.0.1"
check_advertised HOST_A
require CLUSTER_SECRET_FILE "create one with 'moe-fabric cluster-secret PATH' and copy it to both hosts (mode 0600)"
[[ -r "$CLUSTER_SECRET_FILE" ]] || die "CLUSTER_SECRET_FILE=$CLUSTER_SECRET_FILE cannot be read"
if [[ "$ROLE" == b ]]; then
    require HOST_B "set it to this host's address as host A sees it, e.g. HOST_B=10.0.0.2"
    check_advertised HOST_B
fi

ORCH_PORT=${ORCH_PORT:-7000}
GATEWAY_PORT=${GATEWAY_PORT:-8000}
AW_PORT=${AW_PORT:-7100}
EW_PORT=${EW_PORT:-7200}
ORCH_BIND=${ORCH_BIND:-$HOST_A}
GATEWAY_BIND=${GATEWAY_BIND:-$HOST_A}
TLS_CERT=${TLS_CERT:-}
TLS_KEY=${TLS_KEY:-}
TRANSPORT=${TRANSPORT:-tcp}
DTYPE=${DTYPE:-}
THREADS=${THREADS:-1}
GATHER=${GATHER:-sync}
ORCH_WAIT=${ORCH_WAIT:-60}
MOE_FABRIC=${MOE_FABRIC:-moe-fabric}

for p in ORCH_PORT GATEWAY_PORT AW_PORT EW_PORT; do check_port "$p"; done
# `auto` is refused: every process would choose for itself, and two hosts may choose differently.
[[ "$TRANSPORT" == tcp || "$TRANSPORT" == ucx ]] || die "TRANSPORT must be tcp or ucx, got '$TRANSPORT'"
[[ -z "$DTYPE" || "$DTYPE" == float32 || "$DTYPE" == bfloat16 ]] || die "DTYPE must be float32, bfloat16 or empty"
[[ "$GATHER" == sync || "$GATHER" == threshold ]] || die "GATHER must be sync or threshold, got '$GATHER'"
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive integer, got '$THREADS'"
[[ "$ORCH_WAIT" =~ ^[0-9]+$ ]] || die "ORCH_WAIT must be a number of seconds, got '$ORCH_WAIT'"
[[ -z "$TLS_CERT" && -z "$TLS_KEY" || -n "$TLS_CERT" && -n "$TLS_KEY" ]] || die "set both TLS_CERT and TLS_KEY, or neither"
[[ -z "$TLS_CERT" || "$TRANSPORT" == tcp ]] || die "TLS is for TRANSPORT=tcp (UCX has no TLS)"
command -v "$MOE_FABRIC" >/dev/null || die "'$MOE_FABRIC' not found; activate the venv or set MOE_FABRIC"

ORCH="$HOST_A:$ORCH_PORT"
SELF=$([[ "$ROLE" == a ]] && echo "$HOST_A" || echo "$HOST_B")
dtype_args=()
[[ -n "$DTYPE" ]] && dtype_args=(--dtype "$DTYPE")
security_args=(--cluster-secret-file "$CLUSTER_SECRET_FILE")
[[ -n "$TLS_CERT" ]] && security_args+=(--tls-cert "$TLS_CERT" --tls-key "$TLS_KEY")
SCHEME=$([[ -n "$TLS_CERT" ]] && echo https || echo http)
worker_args=(--model "$MODEL_DIR" --orchestrator "$ORCH" --host "$SELF" --transport "$TRANSPORT"
             --threads "$THREADS" ${dtype_args[@]+"${dtype_args[@]}"} "${security_args[@]}")

echo "two-hosts.sh: role $ROLE on $SELF; orchestrator $ORCH; transport $TRANSPORT;" \
     "AW port $AW_PORT, EW port $EW_PORT; model $MODEL_DIR" >&2

PIDS=()
NAMES=()

start() {  # start NAME CMD...
    local name=$1
    shift
    echo "+ $*" >&2
    "$@" &
    PIDS+=($!)
    NAMES+=("$name")
}

supervise() {  # supervise NAME CMD...: like start, and CMD runs again (after 0.5 s) whenever it exits
    local name=$1
    shift
    echo "+ $* (supervised)" >&2
    (
        child=
        trap 'stopping=1; [[ -n "$child" ]] && kill -TERM "$child" 2>/dev/null; wait "$child" 2>/dev/null; exit 0' TERM INT
        stopping=
        while [[ -z "$stopping" ]]; do
            "$@" &
            child=$!
            wait "$child" && rc=0 || rc=$?
            [[ -n "$stopping" ]] && break
            echo "two-hosts.sh: $name exited ($rc); starting it again in 0.5 s" >&2
            sleep 0.5
        done
    ) &
    PIDS+=($!)
    NAMES+=("$name")
}

stop_all() {
    trap - INT TERM EXIT
    local i pid deadline=$((SECONDS + 10))
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do  # reverse start order: gateway first
        [[ -n "${PIDS[i]}" ]] && kill -TERM "${PIDS[i]}" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        [[ -n "$pid" ]] || continue
        while kill -0 "$pid" 2>/dev/null; do
            if ((SECONDS >= deadline)); then
                echo "two-hosts.sh: pid $pid did not stop; killing it" >&2
                kill -KILL "$pid" 2>/dev/null || true
                break
            fi
            sleep 0.2
        done
    done
    wait 2>/dev/null || true
}

trap 'echo "two-hosts.sh: stopping" >&2; stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap stop_all EXIT

orchestrator_up() {
    (exec 3<>"/dev/tcp/$HOST_A/$ORCH_PORT") 2>/dev/null
}

wait_for_orchestrator() {
    local deadline=$((SECONDS + ORCH_WAIT))
    until orchestrator_up; do
        if [[ "$ROLE" == a ]] && ! kill -0 "${PIDS[0]}" 2>/dev/null; then
            die "the orchestrator exited during start-up"
        fi
        ((SECONDS < deadline)) || die "no orchestrator at $ORCH after ${ORCH_WAIT}s (start host A first; check firewalls)"
        sleep 0.5
    done
}

if [[ "$ROLE" == a ]]; then
    supervise orchestrator "$MOE_FABRIC" orchestrator --model "$MODEL_DIR" --expert-workers 2 \
        --host "$ORCH_BIND" --port "$ORCH_PORT" "${security_args[@]}"
fi
# Workers wait for the orchestrator as long as it takes; starting them once it answers keeps the logs quiet.
wait_for_orchestrator
start expert-worker "$MOE_FABRIC" expert-worker "${worker_args[@]}" --port "$EW_PORT" --gather "$GATHER"
start attention-worker "$MOE_FABRIC" attention-worker "${worker_args[@]}" --port "$AW_PORT"
if [[ "$ROLE" == a ]]; then
    supervise gateway "$MOE_FABRIC" gateway --model "$MODEL_DIR" --orchestrator "$ORCH" \
        --host "$GATEWAY_BIND" --port "$GATEWAY_PORT" --transport "$TRANSPORT" "${security_args[@]}"
    echo "two-hosts.sh: cluster view: curl -H \"Authorization: Bearer \$(cat $CLUSTER_SECRET_FILE)\"" \
         "$SCHEME://$HOST_A:$ORCH_PORT/cluster" >&2
    echo "two-hosts.sh: the gateway answers once host B is up: curl $SCHEME://$HOST_A:$GATEWAY_PORT/v1/models" >&2
fi

# Serve until Ctrl-C or SIGTERM (the traps stop everything). A worker that exits is reported; the
# fabric takes over its work (wait -n needs bash >= 4.3).
set +e
while true; do
    wait -n
    rc=$?
    for i in "${!PIDS[@]}"; do
        if [[ -n "${PIDS[i]}" ]] && ! kill -0 "${PIDS[i]}" 2>/dev/null; then
            echo "two-hosts.sh: ${NAMES[i]} (pid ${PIDS[i]}) exited (status $rc); the fabric takes over its work" >&2
            PIDS[i]=
        fi
    done
    if ! kill -0 ${PIDS[@]} 2>/dev/null; then
        echo "two-hosts.sh: nothing left to run" >&2
        exit "$rc"
    fi
done
