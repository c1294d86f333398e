#!/usr/bin/env bash
# Make sure the system programs the test suite starts are installed:
# redis-server and redis-cli (Redis tier tests), promtool and prometheus
# (alert-rule and scrape tests), docker-compose (compose file validation),
# g++ and libssl-dev (SGLang's page-hash extension, built by make setup-sglang),
# podman, runc, debootstrap, uidmap and CNI's dnsname plugin (the images and the CPU
# compose stack of tests/test_deploy_stack.py; scripts/local-base.sh makes their base),
# kubectl (`kubectl kustomize` of deploy/k8s in tests/test_deploy_k8s.py), and the
# libraries Mooncake's CPU build links without bundling (libibverbs1, libnuma1, libcurl4:
# mooncake_master and the store client of the Mooncake tier tests).
# Installs the missing ones with apt-get when run as root on Debian/Ubuntu;
# otherwise says what to install and fails, so a test never silently skips.
set -euo pipefail

declare -A package_of=(
  [redis-server]=redis-server
  [redis-cli]=redis-tools
  [promtool]=prometheus
  [prometheus]=prometheus
  [docker-compose]=docker-compose
  [podman]=podman
  [runc]=runc
  [debootstrap]=debootstrap
  [newuidmap]=uidmap
  [kubectl]=kubernetes-client
)

missing=()
for program in "${!package_of[@]}"; do
  command -v "$program" >/dev/null 2>&1 || missing+=("${package_of[$program]}")
done
# SGLang builds a C++ page-hash extension at its first import (make setup-sglang):
# a compiler and the OpenSSL headers.
command -v g++ >/dev/null 2>&1 || missing+=(g++)
[ -f /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
# Mooncake's binaries load these even over TCP.
for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  ldconfig -p 2>/dev/null | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
done
# podman's CNI backend resolves service names on a compose network only with this plugin.
[ -x /usr/lib/cni/dnsname ] || missing+=(golang-github-containernetworking-plugin-dnsname)
[ ${#missing[@]} -eq 0 ] && exit 0

packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages for the tests: $packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $packages >/dev/null
else
  echo "the tests need these system packages: $packages (install them, e.g. sudo apt-get install $packages)" >&2
  exit 1
fi
