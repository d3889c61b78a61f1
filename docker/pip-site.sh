# Sourced by the Dockerfile's pip steps. A site behind a proxy passes pip's CA bundle and
# package index to `make image`, which hands them to the build as BuildKit secrets, files
# under /run/secrets that exist for one RUN only; this exports the ones given as pip's own
# variables. Never echo them: an index URL may carry a credential (pip masks it in its log).
# shellcheck shell=bash
if [ -s /run/secrets/ca_bundle ]; then
    export PIP_CERT=/run/secrets/ca_bundle
fi
for pip_var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST; do
    secret="/run/secrets/${pip_var,,}"
    if [ -s "$secret" ]; then
        export "$pip_var=$(cat "$secret")"
    fi
done
unset pip_var secret
