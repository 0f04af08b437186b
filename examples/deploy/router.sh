#!/usr/bin/env bash
# The kvlease router in front of N prefill and M decode nodes, with Redis state (shared by replicas).
#
# Required environment:
#   PREFILL_URLS   space-separated, e.g. "http://p0:8100 http://p1:8100"
#   DECODE_URLS    space-separated, e.g. "http://d0:8200 http://d1:8200"
#   KVLEASE_CONTROL_SECRET  the same secret as on the nodes
# Optional: REDIS_URL (redis://redis:6379/0), PORT (8000)
set -euo pipefail
: "${PREFILL_URLS:?}" "${DECODE_URLS:?}" "${KVLEASE_CONTROL_SECRET:?}"
args=()
for u in ${PREFILL_URLS}; do args+=(--prefill "$u"); done
for u in ${DECODE_URLS}; do args+=(--decode "$u"); done
exec kvlease router "${args[@]}" \
  --state "${REDIS_URL:-redis://127.0.0.1:6379/0}" \
  --host 0.0.0.0 --port "${PORT:-8000}"
