#!/bin/bash
# dsv4-pd environment, in the shape of cann-recipes-infer's executor/scripts/set_env.sh.
# Sourced by deploy/infer.sh (or point DSV4_ENV_FILE at your own copy). Edit the arrays below for a
# multi-node setup; a variable already set in the environment wins over the defaults here.
# Defaults: one host, everything on loopback.

# ---- nodes ----------------------------------------------------------------------------------
# Offline multi-node: all servers, the first is the master.
[[ -n "${IPs:-}" ]] || IPs=('127.0.0.1')
# Online P/D: prefill nodes (the first also runs the gateway) and decode nodes. A host in both
# lists (single-host P/D) needs an explicit --pd-role and, on NPUs, disjoint ASCEND_RT_VISIBLE_DEVICES.
[[ -n "${PREFILL_IPS:-}" ]] || PREFILL_IPS=('127.0.0.1')
[[ -n "${DECODE_IPS:-}" ]] || DECODE_IPS=('127.0.0.1')

# ---- ports (every one configurable; upstream hard-codes them) ---------------------------------
export ROUTER_HTTP_PORT="${ROUTER_HTTP_PORT:-8000}"      # gateway, OpenAI API + /metrics
export PREFILL_ZMQ_PORT="${PREFILL_ZMQ_PORT:-5555}"      # prefill worker requests
export PREFILL_HTTP_PORT="${PREFILL_HTTP_PORT:-8001}"    # prefill /health /ready /metrics
export DECODE_ZMQ_PORT="${DECODE_ZMQ_PORT:-5557}"        # decode worker requests (+2: P and D share a host)
export DECODE_STATE_PORT="${DECODE_STATE_PORT:-5558}"    # decode: incoming request state
export DECODE_HTTP_PORT="${DECODE_HTTP_PORT:-8100}"      # decode /health /ready /metrics
export PREFILL_MASTER_PORT="${PREFILL_MASTER_PORT:-6038}"  # torch.distributed rendezvous, prefill instance
export DECODE_MASTER_PORT="${DECODE_MASTER_PORT:-6239}"    # ... decode instance
export PREFILL_HCCL_BASE_PORT="${PREFILL_HCCL_BASE_PORT:-23456}"  # HCCL_IF_BASE_PORT per role
export DECODE_HCCL_BASE_PORT="${DECODE_HCCL_BASE_PORT:-23556}"
# Bind address of the workers / gateway. Unset: loopback on one host, the node's own entry in
# PREFILL_IPS / DECODE_IPS on a multi-node setup (infer.sh decides). Never exported empty.
[[ -z "${DSV4_BIND_HOST:-}" ]] || export DSV4_BIND_HOST
export DSV4_TRANSPORT="${DSV4_TRANSPORT:-zmq-tcp}"          # state transfer: zmq | dist (HCCL/NCCL/gloo p2p)
# DSV4_CLUSTER_SECRET (>= 16 characters, the same on every node; not exported here): CURVE on every
# ZMQ connection and a bearer token on worker HTTP. Without it, bind to a private network only.

# ---- CANN toolkit (only where installed) -----------------------------------------------------
CANN_PATH="${CANN_PATH:-/usr/local/Ascend/ascend-toolkit/latest}"
if [[ -f "${CANN_PATH}/bin/setenv.bash" ]]; then
    _dsv4_opts=$-
    set +u                                              # CANN's scripts read unset variables
    # shellcheck source=/dev/null
    source "${CANN_PATH}/bin/setenv.bash"
    export ASCEND_HOME_PATH="${CANN_PATH}"
    for _v in customize custom_transformer; do         # DeepSeek-V4 custom ops, if built
        # shellcheck source=/dev/null
        [[ ! -f "${CANN_PATH}/opp/vendors/${_v}/bin/set_env.bash" ]] || source "${CANN_PATH}/opp/vendors/${_v}/bin/set_env.bash"
    done
    if [[ $_dsv4_opts == *u* ]]; then set -u; fi
    unset _dsv4_opts _v
fi
# Upstream also runs `rm -rf /root/atc_data/` here; we leave the compiler cache alone.

# ---- HCCL / Gloo / torch_npu (what upstream's function.sh sets) -----------------------------
export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1200}"   # s, link set-up between ranks
export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-1200}"         # s, one collective
export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"
export GLOO_IGNORE_IPV6="${GLOO_IGNORE_IPV6:-1}"
# NIC for Gloo (CPU groups) and HCCL's host socket: lo when the nodes are loopback, else the
# default-route NIC (upstream hard-codes HCCL_SOCKET_IFNAME=enp); left unset if neither is known.
_dsv4_nic=
if [[ " ${IPs[*]} ${PREFILL_IPS[*]} ${DECODE_IPS[*]} " =~ [\ ,](localhost|127\.) ]]; then
    _dsv4_nic=lo
elif command -v ip >/dev/null 2>&1; then
    _dsv4_nic=$(ip route show default 2>/dev/null | awk '{print $5; exit}')
fi
if [[ -n "${_dsv4_nic}" ]]; then
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-${_dsv4_nic}}"
    export HCCL_SOCKET_IFNAME="${HCCL_SOCKET_IFNAME:-${_dsv4_nic}}"
fi
unset _dsv4_nic
# Set per role by infer.sh: HCCL_IF_IP, HCCL_IF_BASE_PORT, HCCL_OP_EXPANSION_MODE=AIV (not 950),
# MASTER_ADDR, MASTER_PORT, NODE_RANK, NNODES.

# ---- export the node lists (bash cannot export arrays): space-separated, as launch-pd reads them
_dsv4_join() { local s="$*"; echo "${s//,/ }"; }
_p=$(_dsv4_join "${PREFILL_IPS[@]}"); _d=$(_dsv4_join "${DECODE_IPS[@]}"); _a=$(_dsv4_join "${IPs[@]}")
unset PREFILL_IPS DECODE_IPS IPs
# shellcheck disable=SC2178  # now scalars on purpose
export PREFILL_IPS="$_p" DECODE_IPS="$_d" IPs="$_a"
unset _p _d _a
unset -f _dsv4_join
