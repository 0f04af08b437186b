#!/usr/bin/env bash
# Decode node (D) of a kvlease P/D deployment on a GPU host.
#
# Required environment:
#   MODEL                   model name or path (identical on P and D)
#   KVLEASE_CONTROL_SECRET  shared secret of the kvlease control endpoints (same on P, D, router)
# Optional:
#   PORT (8200)  SIDE_PORT (5601)  CONTROL_PORT (7200)  HOST_IP (this node's address on the KV network)
#   NIXL_BACKEND (UCX | LIBFABRIC)  TP (1)  TTL (480: how long D retains blocks without a renewal)
#   GPU_MEMORY_UTILIZATION (0.9)
#
# --gpu-memory-utilization: kvlease's staging buffer (kvlease.staging_max_tokens, 8192 tokens by
# default: 2 GiB for a 32B-class model) is allocated outside vLLM's budget, in the
# (1 - utilization) x GPU memory vLLM leaves, with 2 GiB to spare; the connector refuses to start
# when it does not fit there. D keeps async scheduling: as a KV consumer, vLLM defers its frees.
set -euo pipefail
: "${MODEL:?set MODEL}" "${KVLEASE_CONTROL_SECRET:?set KVLEASE_CONTROL_SECRET}"
PORT=${PORT:-8200} SIDE_PORT=${SIDE_PORT:-5601} CONTROL_PORT=${CONTROL_PORT:-7200}
HOST_IP=${HOST_IP:-$(hostname -I | awk '{print $1}')} NIXL_BACKEND=${NIXL_BACKEND:-UCX}
TP=${TP:-1} TTL=${TTL:-480} GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.9}

KV_CONFIG=$(cat <<JSON
{"kv_connector": "KVLeaseConnector",
 "kv_connector_module_path": "kvlease_vllm.connector",
 "kv_role": "kv_consumer",
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
  --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION}" \
  --kv-transfer-config "${KV_CONFIG}"
