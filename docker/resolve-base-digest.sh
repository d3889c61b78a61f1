#!/usr/bin/env bash
# Resolve the digest of the Dockerfile's BASE_IMAGE in its registry and record it as the
# default of `ARG BASE_DIGEST=` in that Dockerfile (make image-digest). Needs the docker client
# and registry access; without them it changes nothing and says so in one line.
#   docker/resolve-base-digest.sh [DOCKERFILE]      (default: Dockerfile)
# DOCKER names the docker client (default: docker). With buildx the digest is the one the tag
# points to (for a multi-platform image, its index); without buildx, `docker manifest inspect`
# gives the digest of the PLATFORM image (default linux/amd64).
set -euo pipefail

dockerfile=${1:-Dockerfile}
docker=${DOCKER:-docker}
platform=${PLATFORM:-linux/amd64}

fail() {
    echo "image-digest: $*" >&2
    exit 1
}

[[ -f $dockerfile ]] || fail "no $dockerfile"
image=$(sed -n 's/^ARG BASE_IMAGE=//p' "$dockerfile" | head -n 1)
[[ -n $image ]] || fail "$dockerfile has no 'ARG BASE_IMAGE=<image:tag>' line"
grep -q '^ARG BASE_DIGEST=' "$dockerfile" || fail "$dockerfile has no 'ARG BASE_DIGEST=' line"
command -v "$docker" >/dev/null 2>&1 ||
    fail "needs the docker client and registry access to resolve $image; no docker here, digest left as it was"

# The last line of what a failed docker command said, for the one-line message.
last_line() { tail -n 1 <<<"$1" | tr -d '\r'; }

if "$docker" buildx version >/dev/null 2>&1; then
    how="docker buildx imagetools inspect"
    out=$("$docker" buildx imagetools inspect "$image" --format '{{.Manifest.Digest}}' 2>&1) ||
        fail "$how $image failed ($(last_line "$out")); digest left as it was"
    digest=$out
else
    how="docker manifest inspect"
    out=$("$docker" manifest inspect --verbose "$image" 2>&1) ||
        fail "$how $image failed ($(last_line "$out")); digest left as it was"
    digest=$(PLATFORM=$platform python3 -c '
import json, os, sys
os_, arch = os.environ["PLATFORM"].split("/")[:2]
entries = json.loads(sys.stdin.read())
entries = entries if isinstance(entries, list) else [entries]
for entry in entries:
    descriptor = entry.get("Descriptor", {})
    found = descriptor.get("platform", {"os": os_, "architecture": arch})
    if (found.get("os"), found.get("architecture")) == (os_, arch):
        print(descriptor.get("digest", ""))
        break
' <<<"$out") || fail "could not read the output of $how $image; digest left as it was"
fi
digest=${digest//[[:space:]]/}
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] ||
    fail "$how gave no sha256 digest for $image ('$digest'); digest left as it was"

sed -i "s|^ARG BASE_DIGEST=.*|ARG BASE_DIGEST=$digest|" "$dockerfile"
echo "image-digest: $image@$digest recorded in $dockerfile ($how)"
