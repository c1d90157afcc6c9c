#!/usr/bin/env bash
# Build the image with Debian's buildah where no registry can be reached and no container
# runtime can start (this project's machines): the base image is made from Debian's packages
# with debootstrap, the same suites as debian:bookworm-slim, and imported as
# localhost/debian:bookworm-slim; buildah runs the Containerfile with chroot isolation on vfs
# storage, the host's CA bundle mounted for pip and cargo. Needs root.
#
#   apt-get install -y buildah podman debootstrap
#   deploy/container/build-local.sh [TAG]        # default localhost/llmflow:0.1.0
#   deploy/container/smoke.sh [TAG]              # then run it as the chart does
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${1:-localhost/llmflow:0.1.0}
BASE=localhost/debian:bookworm-slim
STORE=(--storage-driver vfs)

if ! buildah "${STORE[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  rootfs=$(mktemp -d)
  chmod 0755 "$rootfs"  # it becomes the image's /: mktemp's 0700 would lock out uid 10001
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian
  cat > "$rootfs/etc/apt/sources.list" <<'LIST'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
LIST
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman "${STORE[@]}" import - "$BASE"
fi

buildah "${STORE[@]}" bud --isolation chroot --format docker --layers \
  --build-arg BASE_IMAGE="$BASE" \
  -v /etc/ssl/certs/ca-certificates.crt:/run/ca.crt:ro --build-arg CA_BUNDLE=/run/ca.crt \
  -f deploy/container/Containerfile --ignorefile deploy/container/Containerfile.dockerignore \
  -t "$TAG" .
buildah "${STORE[@]}" images "$TAG"
