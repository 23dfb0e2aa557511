#!/usr/bin/env bash
# `make image-check`: build the image from the committed tree and check it by running it.
#
# No container registry is reachable from these machines, so:
# - podman, buildah, runc and debootstrap come from Debian (apt);
# - the base image python:3.11-slim-bookworm is stood in for by a debootstrapped Debian 12
#   with Debian's Python 3.11 as /usr/local/bin/python, imported under that very name so the
#   Dockerfile builds unchanged (`--pull=never`), with this host's CA bundle (HTTPS from
#   inside the build goes through the same trust store as the host's pip);
# - CPU torch comes from the wheel on this disk, served on 127.0.0.1 as TORCH_INDEX_URL.
# Known quirks of this machine kind, handled here: crun refuses its hybrid cgroup layout
# (runc, through a containers.conf), podman's default ulimits exceed the hard limits
# (tools/image_check.py passes --ulimit within the hard limits), no systemd (tools/image_check.py runs `podman
# healthcheck run` itself). About 5 minutes and 4 GB of container storage (each run replaces
# the last run's image); the base is cached under $KVSTORE_IMAGE_WORK (default
# /var/tmp/kvstore-image).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
work="${KVSTORE_IMAGE_WORK:-/var/tmp/kvstore-image}"
image="${KVSTORE_IMAGE:-localhost/kvstore:check}"
base="docker.io/library/python:3.11-slim-bookworm"
py="${PY:-$here/.venv/bin/python}"
mkdir -p "$work"
say() { printf 'image-check: %s\n' "$*" >&2; }

if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null \
    || ! command -v runc >/dev/null || ! command -v buildah >/dev/null; then
  say "installing podman, buildah, runc and debootstrap (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq podman buildah runc debootstrap >/dev/null
fi

conf="$work/containers.conf"
printf '[engine]\nruntime = "runc"\n' > "$conf"  # ulimits: tools/image_check.py passes them
export CONTAINERS_CONF="$conf"

# Container storage is bounded to one checked image plus the base: what an earlier check
# left (its image, containers and volumes of an interrupted run, layers no tag names) goes
# first, the build keeps no per-step cache (--layers=false), and a host without room for a
# build fails here with the figures rather than halfway through a layer.
store="$(podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage)"
prune() {
  podman ps -a --format '{{.Names}}' | grep '^kvc-' | xargs -r podman rm -f >/dev/null 2>&1 || true
  podman volume ls --format '{{.Name}}' | grep '^kvc-' | xargs -r podman volume rm -f >/dev/null 2>&1 || true
  podman rmi -f "$image" >/dev/null 2>&1 || true
  podman image prune -f >/dev/null 2>&1 || true
}
prune
need_gb="${KVSTORE_IMAGE_NEED_GB:-8}"
mkdir -p "$store"
free_gb=$(df -Pk "$store" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt "$need_gb" ]; then
  say "only ${free_gb} GiB free under $store; a build needs about ${need_gb} GiB (KVSTORE_IMAGE_NEED_GB)"
  df -h "$store" >&2
  podman system df >&2 2>/dev/null || true
  exit 1
fi

if ! podman image exists "$base"; then
  say "making the stand-in for $base with debootstrap (a few minutes, once)"
  rm -rf "$work/base"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
    bookworm "$work/base" http://deb.debian.org/debian > "$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  ln -sf /usr/bin/python3 "$work/base/usr/local/bin/python"
  cp /etc/ssl/certs/ca-certificates.crt "$work/base/etc/ssl/certs/ca-certificates.crt"
  tar -C "$work/base" -c . | podman import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' \
    - "$base" >/dev/null
  rm -rf "$work/base"
fi

wheel="$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)"
[ -n "$wheel" ] || { say "no local CPU torch wheel in /opt/wheels"; exit 1; }
idx="$work/torch-index"
rm -rf "$idx" && mkdir -p "$idx/simple/torch" && ln -s "$wheel" "$idx/simple/torch/"
port="$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
(cd "$idx" && exec "$py" -m http.server "$port" --bind 127.0.0.1 >/dev/null 2>&1) &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT

ctx="$work/context"
rm -rf "$ctx" && mkdir -p "$ctx"
git -C "$here" archive HEAD | tar -x -C "$ctx"
say "building $image from $(git -C "$here" rev-parse --short HEAD) (podman $(podman --version | awk '{print $3}'))"
start=$(date +%s)
podman build --network host --format docker --pull=never --layers=false \
  --build-arg "TORCH_INDEX_URL=http://127.0.0.1:$port/simple" -t "$image" "$ctx" \
  > "$work/build.log" 2>&1 || {
    tail -40 "$work/build.log" >&2; df -h "$store" >&2; podman image prune -f >/dev/null 2>&1 || true
    say "build failed"; exit 1; }
kill "$server" 2>/dev/null || true  # the torch index is for the build only
podman image prune -f >/dev/null 2>&1 || true  # what the build stage left
say "built in $(( $(date +%s) - start )) s, $(podman image inspect "$image" --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"

# Not exec: the EXIT trap must still run (an exec'd shell never runs it, and the index
# server outlived the check, holding whatever the caller's descriptors held: a lock).
"$py" "$here/tools/image_check.py" --image "$image" --base "$base"
