# syntax=docker/dockerfile:1
# Redis and Prometheus from Debian's packages, for the CPU stack (deploy/compose.cpu.yml)
# on machines that cannot pull redis:7.4-alpine and prom/prometheus from a registry: the
# tests build it from the local base of scripts/local-base.sh and pass it as REDIS_IMAGE
# and PROMETHEUS_IMAGE.  Runs as nobody; no network at run time.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o nobody -g nogroup -m 0750 /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 6379 9090
