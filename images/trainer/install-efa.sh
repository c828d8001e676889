#!/usr/bin/env bash
# Install AWS's EFA user-space stack in an image: libfabric with the EFA provider and rdma-core under
# /opt/amazon/efa, Open MPI under /opt/amazon/openmpi (how nccl-tests spans nodes). The installer is
# checked against its published sha256 before it runs. The kernel driver belongs to the host (the deep
# learning AMI has it), so it is skipped, and so are the host's memlock limits and the device check.
# Usage: install-efa.sh VERSION SHA256
set -euo pipefail
version="$1"
sha256="$2"
work="$(mktemp -d)"
cd "$work"
curl --fail --silent --show-error --location --proto '=https' --tlsv1.2 \
  --output efa.tar.gz "https://efa-installer.amazonaws.com/aws-efa-installer-${version}.tar.gz"
echo "${sha256}  efa.tar.gz" | sha256sum --check --strict -
tar -xzf efa.tar.gz
apt-get update
(cd aws-efa-installer && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify)
rm -rf "$work" /var/lib/apt/lists/*
