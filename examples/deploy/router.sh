#!/usr/bin/env bash
# The kvlease router in front of N prefill and M decode nodes, with Redis state (shared by replicas).
#
# Required environment:
#   PREFILL_URLS            space-separated, e.g. "http://p0:8100 http://p1:8100"
#   PREFILL_CONTROL_URLS    their kvlease control endpoints, same order, e.g. "http://p0:7100 http://p1:7100"
#   DECODE_URLS             space-separated, e.g. "http://d0:8200 http://d1:8200"
#   DECODE_CONTROL_URLS     their kvlease control endpoints, same order, e.g. "http://d0:7200 http://d1:7200"
#   KVLEASE_CONTROL_SECRET  the same secret as on the nodes
#   KVLEASE_KEY_SECRET      HMAC key of the state keys: the same on every router replica sharing Redis
# Optional: REDIS_URL (redis://127.0.0.1:6379/0), PORT (8000), UPSTREAM_CONNECTIONS (256 per node)
set -euo pipefail
: "${PREFILL_URLS:?}" "${PREFILL_CONTROL_URLS:?}" "${DECODE_URLS:?}" "${DECODE_CONTROL_URLS:?}"
: "${KVLEASE_CONTROL_SECRET:?}" "${KVLEASE_KEY_SECRET:?}"
args=()
for u in ${PREFILL_URLS}; do args+=(--prefill "$u"); done
for u in ${PREFILL_CONTROL_URLS}; do args+=(--prefill-control "$u"); done
for u in ${DECODE_URLS}; do args+=(--decode "$u"); done
for u in ${DECODE_CONTROL_URLS}; do args+=(--decode-control "$u"); done
# the router reads its HMAC key from KVLEASE_ROUTER_KEY_SECRET (kept out of the command line)
export KVLEASE_ROUTER_KEY_SECRET="${KVLEASE_KEY_SECRET}"
exec kvlease router "${args[@]}" \
  --state "${REDIS_URL:-redis://127.0.0.1:6379/0}" \
  --upstream-connections "${UPSTREAM_CONNECTIONS:-256}" \
  --host 0.0.0.0 --port "${PORT:-8000}"
