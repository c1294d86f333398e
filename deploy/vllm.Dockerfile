# syntax=docker/dockerfile:1
# vLLM's OpenAI server with the lmcache-server client installed, so that
# --kv-transfer-config can load lmcache_client.integrations.vllm.connector.
# Build from the repository root:
#
#   docker build -f deploy/vllm.Dockerfile -t lmcache-vllm .
# The connector follows vLLM 0.32's KV connector API and KV cache layouts (docs/integrations.md).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY client/ /tmp/lmcache-client/
# The vLLM images install packages with uv; fall back to pip for older ones.
RUN if command -v uv >/dev/null 2>&1; then uv pip install --system --no-cache /tmp/lmcache-client; \
    else python3 -m pip install --no-cache-dir /tmp/lmcache-client; fi \
    && python3 -c "import lmcache_client" \
    && rm -rf /tmp/lmcache-client
