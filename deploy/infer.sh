#!/bin/bash
# Launch dsv4-pd on this node with cann-recipes-infer's infer.sh flags, mapped onto launch-pd /
# dsv4-offline (see deploy/README.md). Run it on every node, as upstream; no orchestrator.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "${SCRIPT_DIR}/.." && pwd)
PROG=infer.sh

die() { echo "${PROG}: error: $*" >&2; exit 2; }
warn() { echo "${PROG}: warning: $*" >&2; }
info() { echo "${PROG}: $*" >&2; }
usage() {
    cat <<EOF
Usage: $0 --mode online|offline [--model NAME|DIR] [--pd-role prefill|decode|gateway|local]
          [--yaml FILE] [--p-yaml-name FILE] [--d-yaml-name FILE] [--out FILE] [--dry-run]

  --model NAME|DIR   checkpoint directory (else model_config.model_path); a bare name such as
                     deepseek_v4 is accepted as upstream's model name and otherwise unused
  --mode             online (P/D serving) or offline (dsv4-offline over a dataset); default offline
  --pd-role          online: prefill | decode | gateway | local (all three on this host);
                     empty: from this host's address in PREFILL_IPS / DECODE_IPS
  --yaml FILE        offline / local run config (default tiny-flash.yaml)
  --p-yaml-name FILE prefill run config (default deepseek-v4-flash-a3-prefill.yaml)
  --d-yaml-name FILE decode run config (default deepseek-v4-flash-a3-decode.yaml)
                     FILE: a path, or a name under configs/
  --engine-backend X accepted for compatibility and ignored (set DSV4_TRANSPORT=zmq-tcp|zmq-ipc|dist)
  --out FILE         offline output JSONL (default out/offline-<yaml>.jsonl)
  --dry-run          print the command(s) instead of running them
Environment: deploy/set_env.sh (or DSV4_ENV_FILE); DSV4_LOCAL_IP overrides \`hostname -I\`;
DSV4_START_GATEWAY=0 keeps the first prefill node from starting the gateway.
EOF
}

MODEL="" MODE="offline" PD_ROLE="" YAML_FILE="" P_YAML_NAME="" D_YAML_NAME="" OUT="" DRY_RUN=0
while [[ $# -gt 0 ]]; do
    flag=$1
    if [[ $flag == --*=* ]]; then set -- "${flag%%=*}" "${flag#*=}" "${@:2}"; flag=$1; fi
    case $flag in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1; shift; continue ;;
        --model|--mode|--pd-role|--pd_role|--yaml|--p-yaml-name|--p_yaml_name|--d-yaml-name|--d_yaml_name) ;;
        --engine-backend|--engine_backend|--out) ;;
        *) die "unknown option: ${flag} (see --help)" ;;
    esac
    [[ $# -ge 2 && $2 != --* ]] || die "${flag}: missing value (see --help)"
    case $flag in
        --model) MODEL=$2 ;;
        --mode) MODE=$2 ;;
        --pd-role|--pd_role) PD_ROLE=$2 ;;
        --yaml) YAML_FILE=$2 ;;
        --p-yaml-name|--p_yaml_name) P_YAML_NAME=$2 ;;
        --d-yaml-name|--d_yaml_name) D_YAML_NAME=$2 ;;
        --engine-backend|--engine_backend)
            warn "--engine-backend '$2' ignored: dsv4-pd has its own transports (DSV4_TRANSPORT=zmq-tcp|zmq-ipc|dist)" ;;
        --out) OUT=$2 ;;
    esac
    shift 2
done

case $MODE in online|offline) ;; *) die "--mode: must be 'online' or 'offline', got '${MODE}'" ;; esac
case $PD_ROLE in
    ""|prefill|decode|gateway|local) ;;
    *) die "--pd-role: must be prefill, decode, gateway, local or empty, got '${PD_ROLE}'" ;;
esac
[[ $MODE == online || -z $PD_ROLE ]] || die "--pd-role: only with --mode online"
[[ $MODE == offline || -z $OUT ]] || die "--out: only with --mode offline"

abspath() {   # PATH -> absolute (its directory need not exist yet)
    if [[ -d $(dirname "$1") ]]; then (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")")
    elif [[ $1 == /* ]]; then echo "$1"
    else echo "${PWD}/$1"; fi
}
resolve_yaml() {   # FLAG VALUE -> absolute path of an existing YAML
    local c
    for c in "$2" "${REPO_ROOT}/configs/$2" "${REPO_ROOT}/configs/$2.yaml"; do
        if [[ -f $c ]]; then abspath "$c"; return; fi
    done
    die "$1: YAML file not found: '$2' (looked in . and ${REPO_ROOT}/configs/)"
}
MODEL_ARGS=()
if [[ -n $MODEL ]]; then
    if [[ -d $MODEL ]]; then
        MODEL_ARGS=(--model "$(abspath "$MODEL")")
    elif [[ $MODEL == */* ]]; then
        die "--model: checkpoint directory not found: '${MODEL}'"
    else
        info "--model '${MODEL}' is not a directory: taken as the model name; the checkpoint is model_config.model_path"
    fi
fi
if [[ $MODE == offline || $PD_ROLE == local ]]; then
    YAML=$(resolve_yaml --yaml "${YAML_FILE:-tiny-flash.yaml}")
else
    [[ -z $YAML_FILE ]] || warn "--yaml ignored in online mode (use --p-yaml-name / --d-yaml-name, or --pd-role local)"
    P_YAML=$(resolve_yaml --p-yaml-name "${P_YAML_NAME:-deepseek-v4-flash-a3-prefill.yaml}")
    D_YAML=$(resolve_yaml --d-yaml-name "${D_YAML_NAME:-deepseek-v4-flash-a3-decode.yaml}")
fi
[[ -z $OUT ]] || OUT=$(abspath "$OUT")

ENV_FILE=${DSV4_ENV_FILE:-${SCRIPT_DIR}/set_env.sh}
[[ -f $ENV_FILE ]] || die "DSV4_ENV_FILE: not found: '${ENV_FILE}'"
# shellcheck source=deploy/set_env.sh
source "$ENV_FILE"
cd "$REPO_ROOT"    # relative paths in the YAMLs (model_path, dataset_path) are from the repo root

PY=${DSV4_PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x ${REPO_ROOT}/.venv/bin/python ]]; then PY=${REPO_ROOT}/.venv/bin/python; else PY=python3; fi
fi
tool() {   # NAME -> the console script to run (PATH, else the repo's .venv)
    if command -v "$1" >/dev/null 2>&1; then echo "$1"
    elif [[ -x ${REPO_ROOT}/.venv/bin/$1 ]]; then echo "${REPO_ROOT}/.venv/bin/$1"
    else echo "$1"; fi
}
show() {   # ARGS -> one shell-quoted line (plain words left as they are)
    local a out=()
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./:,=@%+-]+$ ]]; then out+=("$a"); else out+=("$(printf '%q' "$a")"); fi
    done
    echo "${out[*]}"
}
run_fg() {   # exec the command (or print it)
    if (( DRY_RUN )); then echo "[dry-run] $(show "$@")"; exit 0; fi
    command -v "$1" >/dev/null 2>&1 || die "$1: not found (run scripts/setup.sh, or put .venv/bin on PATH)"
    exec "$@"
}

# ---- offline --------------------------------------------------------------------------------
if [[ $MODE == offline ]]; then
    stem=$(basename "$YAML" .yaml)
    OUT=${OUT:-${REPO_ROOT}/out/offline-${stem}.jsonl}
    (( DRY_RUN )) || mkdir -p "$(dirname "$OUT")"
    info "launch offline inference (config=${YAML})"
    run_fg "$(tool dsv4-offline)" --config "$YAML" "${MODEL_ARGS[@]}" --out "$OUT"
fi

# ---- online ---------------------------------------------------------------------------------
if [[ $PD_ROLE == local ]]; then
    info "launch prefill + decode + gateway on this host (config=${YAML})"
    run_fg "$(tool launch-pd)" --role local --config "$YAML" "${MODEL_ARGS[@]}" --port "$ROUTER_HTTP_PORT"
fi

yaml_info() {   # FLAG FILE -> "world_size platform_version"; validates the file with RunConfig
    PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}" "$PY" - "$1" "$2" <<'EOF'
import sys
flag, path = sys.argv[1:3]
try:
    from engine.run_config import ConfigError, RunConfig
except ImportError:          # no dsv4-pd on this python: read the two keys only
    import yaml
    raw = yaml.safe_load(open(path)) or {}
    ws = (raw.get("parallel_config") or {}).get("world_size", 1)
    print(ws, (raw.get("model_config") or {}).get("platform_version"))
    sys.exit(0)
try:
    cfg = RunConfig.from_yaml(path)
except ConfigError as e:
    print(f"infer.sh: error: {flag}: {e}", file=sys.stderr)
    sys.exit(2)
print(cfg.parallel_config.world_size, cfg.model_config.platform_version)
EOF
}
read -r -a _P <<< "$(s="${PREFILL_IPS[*]:-}"; echo "${s//,/ }")"
read -r -a _D <<< "$(s="${DECODE_IPS[*]:-}"; echo "${s//,/ }")"
P_LIST=("${_P[@]}") D_LIST=("${_D[@]}")
[[ ${#P_LIST[@]} -gt 0 ]] || die "PREFILL_IPS is empty (set it in ${ENV_FILE})"
[[ ${#D_LIST[@]} -gt 0 ]] || die "DECODE_IPS is empty (set it in ${ENV_FILE})"
P_INFO=$(yaml_info --p-yaml-name "$P_YAML")
D_INFO=$(yaml_info --d-yaml-name "$D_YAML")
read -r P_WS P_PLAT <<< "$P_INFO"
read -r D_WS D_PLAT <<< "$D_INFO"

LOCAL_IP=${DSV4_LOCAL_IP:-$(hostname -I 2>/dev/null | awk '{print $1}' || true)}
is_loopback() { [[ $1 == localhost || $1 == 127.* || $1 == ::1 ]]; }
is_local() { is_loopback "$1" || [[ -n $LOCAL_IP && $1 == "$LOCAL_IP" ]]; }
local_index() {   # HOSTS... -> index of the first local one, or -1
    local i=0 h
    for h in "$@"; do if is_local "$h"; then echo "$i"; return; fi; i=$((i + 1)); done
    echo -1
}
nodes_per_instance() {   # WORLD_SIZE PLATFORM -> nodes one instance spans (16 devices on A3, 8 on 950)
    local dpn=${DEVICES_PER_NODE:-16}
    [[ -n ${DEVICES_PER_NODE:-} || $2 != 950 ]] || dpn=8
    (( dpn <= $1 )) || dpn=$1
    echo $(( ($1 + dpn - 1) / dpn ))
}
leaders() {   # STEP PORT HOSTS... -> host:port of every instance leader, comma-separated
    local step=$1 port=$2 out=() i; shift 2
    local hosts=("$@")
    for ((i = 0; i < ${#hosts[@]}; i += step)); do out+=("${hosts[$i]}:${port}"); done
    local IFS=,; echo "${out[*]}"
}
P_NPI=$(nodes_per_instance "$P_WS" "$P_PLAT")
D_NPI=$(nodes_per_instance "$D_WS" "$D_PLAT")
(( ${#P_LIST[@]} >= P_NPI )) || die "PREFILL_IPS: ${#P_LIST[@]} node(s), world_size ${P_WS} needs ${P_NPI}"
(( ${#D_LIST[@]} >= D_NPI )) || die "DECODE_IPS: ${#D_LIST[@]} node(s), world_size ${D_WS} needs ${D_NPI}"
P_IDX=$(local_index "${P_LIST[@]}")
D_IDX=$(local_index "${D_LIST[@]}")
here="this host (${LOCAL_IP:-address unknown})"

if [[ -z $PD_ROLE ]]; then
    if (( P_IDX >= 0 && D_IDX >= 0 )); then
        die "--pd-role: ${here} is in both PREFILL_IPS and DECODE_IPS (single-host P/D): pass --pd-role prefill|decode|local"
    elif (( P_IDX >= 0 )); then PD_ROLE=prefill
    elif (( D_IDX >= 0 )); then PD_ROLE=decode
    else die "--pd-role: ${here} is in neither PREFILL_IPS (${P_LIST[*]}) nor DECODE_IPS (${D_LIST[*]}); pass --pd-role or set DSV4_LOCAL_IP"
    fi
    info "inferred --pd-role ${PD_ROLE} from ${here}"
elif [[ $PD_ROLE == prefill ]] && (( P_IDX < 0 )); then
    die "--pd-role prefill: ${here} is not in PREFILL_IPS (${P_LIST[*]})"
elif [[ $PD_ROLE == decode ]] && (( D_IDX < 0 )); then
    die "--pd-role decode: ${here} is not in DECODE_IPS (${D_LIST[*]})"
fi
if [[ $PD_ROLE != gateway ]] && (( P_IDX >= 0 && D_IDX >= 0 )) && [[ -e /dev/davinci_manager ]] &&
   [[ -z ${ASCEND_RT_VISIBLE_DEVICES+x} ]]; then
    die "single-host P/D needs ASCEND_RT_VISIBLE_DEVICES set per role (e.g. 0-7 for prefill, 8-15 for decode)"
fi

bind_host() {   # HOST-ENTRY -> address to bind: DSV4_BIND_HOST, else the node's own non-loopback entry
    if [[ -n ${DSV4_BIND_HOST:-} ]]; then echo "$DSV4_BIND_HOST"
    elif [[ -z $1 ]] || is_loopback "$1"; then echo 127.0.0.1
    else echo "$1"; fi
}
TRANSPORT_ARGS=(--transport "${DSV4_TRANSPORT:-zmq-tcp}")
LAUNCH=$(tool launch-pd)
gateway_cmd() {
    local host=""
    (( P_IDX < 0 )) || host=${P_LIST[$P_IDX]}
    GW_CMD=("$LAUNCH" --role gateway --config "$D_YAML" "${MODEL_ARGS[@]}"
            --host "${DSV4_GATEWAY_HOST:-$(bind_host "$host")}" --port "$ROUTER_HTTP_PORT"
            --prefill-addrs "$(leaders "$P_NPI" "$PREFILL_ZMQ_PORT" "${P_LIST[@]}")"
            --decode-addrs "$(leaders "$D_NPI" "$DECODE_ZMQ_PORT" "${D_LIST[@]}")")
    [[ -z ${DSV4_SERVED_MODEL_NAME:-} ]] || GW_CMD+=(--served-model-name "$DSV4_SERVED_MODEL_NAME")
}

if [[ $PD_ROLE == gateway ]]; then
    gateway_cmd
    info "launch gateway"
    run_fg "${GW_CMD[@]}"
fi

# prefill / decode worker: torch.distributed / HCCL env of this node's instance (upstream function.sh)
if [[ $PD_ROLE == prefill ]]; then
    IDX=$P_IDX NPI=$P_NPI PLAT=$P_PLAT CONF=$P_YAML LIST=("${P_LIST[@]}")
    export MASTER_PORT=$PREFILL_MASTER_PORT HCCL_IF_BASE_PORT=$PREFILL_HCCL_BASE_PORT
    CMD=("$LAUNCH" --role prefill --config "$CONF" "${MODEL_ARGS[@]}" --port "$PREFILL_ZMQ_PORT"
         --http-port "$PREFILL_HTTP_PORT" "${TRANSPORT_ARGS[@]}")
else
    IDX=$D_IDX NPI=$D_NPI PLAT=$D_PLAT CONF=$D_YAML LIST=("${D_LIST[@]}")
    export MASTER_PORT=$DECODE_MASTER_PORT HCCL_IF_BASE_PORT=$DECODE_HCCL_BASE_PORT
    CMD=("$LAUNCH" --role decode --config "$CONF" "${MODEL_ARGS[@]}" --port "$DECODE_ZMQ_PORT"
         --state-port "$DECODE_STATE_PORT" --http-port "$DECODE_HTTP_PORT" "${TRANSPORT_ARGS[@]}")
fi
NODE=${LIST[$IDX]}
CMD+=(--host "$(bind_host "$NODE")")
export MASTER_ADDR=${LIST[$(( IDX / NPI * NPI ))]} NODE_RANK=$(( IDX % NPI )) NNODES=$NPI
is_loopback "$NODE" || export HCCL_IF_IP=$NODE
[[ $PLAT == 950 ]] || export HCCL_OP_EXPANSION_MODE=${HCCL_OP_EXPANSION_MODE:-AIV}

START_GW=0
if [[ $PD_ROLE == prefill && $P_IDX == 0 && ${DSV4_START_GATEWAY:-1} != 0 ]]; then START_GW=1; gateway_cmd; fi
info "launch ${PD_ROLE} (node ${IDX} of ${#LIST[@]}, instance leader ${MASTER_ADDR}, config=${CONF})"
if (( DRY_RUN )); then
    echo "[dry-run] env MASTER_ADDR=${MASTER_ADDR} MASTER_PORT=${MASTER_PORT} NODE_RANK=${NODE_RANK} NNODES=${NNODES} HCCL_IF_BASE_PORT=${HCCL_IF_BASE_PORT}"
    (( ! START_GW )) || echo "[dry-run] $(show "${GW_CMD[@]}") &"
    run_fg "${CMD[@]}"
fi
if (( START_GW )); then
    command -v "$LAUNCH" >/dev/null 2>&1 || die "${LAUNCH}: not found (run scripts/setup.sh, or put .venv/bin on PATH)"
    LOG_DIR=${DSV4_LOG_DIR:-${REPO_ROOT}/logs}
    mkdir -p "$LOG_DIR"
    "${GW_CMD[@]}" >"${LOG_DIR}/gateway.log" 2>&1 &
    GW_PID=$!
    info "gateway started in the background (pid ${GW_PID}, log ${LOG_DIR}/gateway.log)"
    trap 'kill "$GW_PID" 2>/dev/null || true' EXIT
    trap 'exit 143' INT TERM
    "${CMD[@]}"     # not exec: the EXIT trap stops the gateway with the worker
    exit 0
fi
run_fg "${CMD[@]}"
