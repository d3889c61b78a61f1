#!/usr/bin/env bash
# A Debian bookworm base image made here with debootstrap and `docker import`, for building the
# image where no registry can be reached (CI, this repository's machines): bookworm ships
# python3.11, the lock's Python, and the Dockerfile installs Python, compilers, git and the CA
# certificates itself from the base's own apt sources. The CUDA base stays the default.
#   docker/debootstrap-base.sh NAME:TAG [MIRROR]    (as root: needs debootstrap and a docker engine)
#   make image BASE_IMAGE=NAME:TAG
# DOCKER names the docker client (default: docker).
set -euo pipefail

name=${1:-}
mirror=${2:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}

fail() {
    echo "debootstrap-base: $*" >&2
    exit 1
}

[[ -n $name ]] || fail "no image name given; usage: docker/debootstrap-base.sh NAME:TAG [MIRROR]"
command -v debootstrap >/dev/null 2>&1 || fail "needs debootstrap (apt-get install debootstrap), as root"
"$docker" info >/dev/null 2>&1 || fail "no docker engine answers $docker; start dockerd first"

root=$(mktemp -d /var/tmp/recipes-base.XXXXXX)
log="$root.log"
trap 'rm -rf "$root" "$log"' EXIT
if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    fail "debootstrap of bookworm from $mirror failed (its last lines above)"
fi
tar -C "$root" -c . | "$docker" import --change 'CMD ["/bin/bash"]' - "$name" >/dev/null
echo "debootstrap-base: made $name ($("$docker" image inspect --format '{{.Size}}' "$name") bytes)"
