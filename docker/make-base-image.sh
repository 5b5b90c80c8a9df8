#!/bin/sh
# Make a Debian bookworm base image without a registry: debootstrap a minimal root
# file system (python3, venv, pip, iproute2 for tc, ca-certificates) and import it.
#   docker/make-base-image.sh [NAME]     (default stella-base:bookworm; needs root)
# The images' default base stays the official python image; pass this one with
#   --build-arg BASE_IMAGE=stella-base:bookworm
set -eu
NAME=${1:-stella-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$NAME" >/dev/null 2>&1; then
    echo "base image $NAME exists"; exit 0
fi
ROOTFS=$(mktemp -d /tmp/stella-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,iproute2,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
# what a container needs none of: apt lists, caches, docs
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/usr/share/doc/* \
       "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
tar -C "$ROOTFS" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    -c 'CMD ["/bin/bash"]' - "$NAME"
echo "made base image $NAME"
