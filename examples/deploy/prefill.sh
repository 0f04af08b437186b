#!/usr/bin/env bash
# Prefill node (P) of a kvlease P/D deployment on a GPU host.
#
# Required environment:
#   MODEL                   model name or path (identical on P and D)
#   KVLEASE_CONTROL_SECRET  shared secret of the kvlease control endpoints (same on P, D, router)
# Optional:
#   PORT (8100)  SIDE_PORT (5600)  CONTROL_PORT (7100)  HOST_IP (this node's address on the KV network)
#   NIXL_BACKEND (UCX | LIBFABRIC)  TP (1)  TTL (480, must equal D's decoder_kv_blocks_ttl)
#   GPU_MEMORY_UTILIZATION (0.9)
#
# --no-async-scheduling: P loads KV from D (bidirectional_kv_xfer), and with async scheduling vLLM
# defers freeing a finished or aborted request's blocks only on a KV consumer, so a pull could land
# in blocks a step in flight still writes. The connector refuses kv_producer with async scheduling
# (or kv_role kv_both, which vLLM counts as a consumer, instead of this flag).
# --gpu-memory-utilization: kvlease's staging buffer (kvlease.staging_max_tokens, 8192 tokens by
# default: 2 GiB for a 32B-class model) is allocated outside vLLM's budget, in the
# (1 - utilization) x GPU memory vLLM leaves, with 2 GiB to spare; the connector refuses to start
# when it does not fit there.
set -euo pipefail
: "${MODEL:?set MODEL}" "${KVLEASE_CONTROL_SECRET:?set KVLEASE_CONTROL_SECRET}"
PORT=${PORT:-8100} SIDE_PORT=${SIDE_PORT:-5600} CONTROL_PORT=${CONTROL_PORT:-7100}
HOST_IP=${HOST_IP:-$(hostname -I | awk '{print $1}')} NIXL_BACKEND=${NIXL_BACKEND:-UCX}
TP=${TP:-1} TTL=${TTL:-480} GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.9}

KV_CONFIG=$(cat <<JSON
{"kv_connector": "KVLeaseConnector",
 "kv_connector_module_path": "kvlease_vllm.connector",
 "kv_role": "kv_producer",
 "kv_load_failure_policy": "recompute",
 "kv_connector_extra_config": {
   "backends": ["${NIXL_BACKEND}"],
   "bidirectional_kv_xfer": true,
   "kv_recompute_threshold": 64,
   "decoder_kv_blocks_ttl": ${TTL},
   "kvlease": {"control_host": "0.0.0.0", "control_port": ${CONTROL_PORT},
               "control_advertise_host": "${HOST_IP}"}}}
JSON
)

export VLLM_NIXL_SIDE_CHANNEL_HOST="${HOST_IP}" VLLM_NIXL_SIDE_CHANNEL_PORT="${SIDE_PORT}"
exec vllm serve "${MODEL}" --host 0.0.0.0 --port "${PORT}" \
  --tensor-parallel-size "${TP}" \
  --no-async-scheduling \
  --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION}" \
  --kv-transfer-config "${KV_CONFIG}"
