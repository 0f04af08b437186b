# The kvlease router image (no vLLM, NIXL or torch).
#   docker build -f router.Dockerfile -t kvlease-router:0.2.0 .
FROM python:3.12-slim
ARG KVLEASE_VERSION=0.2.0
RUN pip install --no-cache-dir "kvlease[router]==${KVLEASE_VERSION}"
USER 65534
ENTRYPOINT ["kvlease", "router"]
