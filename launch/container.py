"""A request's docker settings from the environment: the client, the network, and what an
image build takes from the site (BASE_IMAGE, CA_BUNDLE and pip's index settings).

pip's index settings may carry a credential (https://user:token@host/simple). They reach the
build as BuildKit secrets, by name, so the rendered command never holds them; the one line
that tells what a build uses shows them with the credential masked, as pip's own log does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from launch.errors import UserError
from launch.render import Docker

PIP_SETTINGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")
NETWORK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")  # a docker network: host, none, a name
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]*")  # name[:tag][@digest]
MASK = "****"


def docker_settings(env: Mapping[str, str], target: str) -> Docker:
    """The client and network of the docker targets; the build's site settings for `image`
    only (a run never reads them, so a stale CA_BUNDLE cannot stop one)."""
    if target not in ("docker", "image"):
        return Docker()
    network = env.get("DOCKER_NETWORK", "")
    if network and not NETWORK.fullmatch(network):
        raise UserError(
            f"DOCKER_NETWORK={network!r} is not a docker network name; e.g. DOCKER_NETWORK=host "
            "where the docker daemon runs without a bridge"
        )
    client = env.get("DOCKER") or "docker"
    if client.startswith("-"):  # `env` would read it as an option
        raise UserError(
            f"DOCKER={client!r} is not a program; name the docker client, e.g. /usr/bin/docker"
        )
    if target != "image":
        return Docker(client=client, network=network)
    return Docker(
        client=client,
        network=network,
        base_image=base_image(env),
        ca_bundle=ca_bundle(env),
        pip_settings=tuple(name for name in PIP_SETTINGS if env.get(name, "").strip()),
    )


def base_image(env: Mapping[str, str]) -> str:
    base = env.get("BASE_IMAGE", "")
    if base and not IMAGE_REF.fullmatch(base):
        raise UserError(
            f"BASE_IMAGE={base!r} is not an image reference; give name:tag, e.g. "
            "BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu22.04, or leave it unset for that default"
        )
    return base


def ca_bundle(env: Mapping[str, str]) -> str:
    given = env.get("CA_BUNDLE", "")
    if not given:
        return ""
    path = Path(given).expanduser()
    if not path.is_file() or not os.access(path, os.R_OK):
        raise UserError(
            f"CA_BUNDLE={given!r} is not a readable file; give the site's CA bundle (PEM), "
            "e.g. CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt, or leave it unset"
        )
    return str(path.resolve())


def build_note(docker: Docker, env: Mapping[str, str]) -> tuple[str, ...]:
    """One line naming the site settings a build receives as secrets, credentials masked."""
    settings = [f"CA_BUNDLE={docker.ca_bundle}"] if docker.ca_bundle else []
    settings += [f"{name}={mask_credentials(env[name])}" for name in docker.pip_settings]
    if not settings:
        return ()
    return (f"launch: note: image: {', '.join(settings)}: passed to the build as BuildKit secrets",)


def mask_credentials(text: str) -> str:
    """Each URL of a space-separated list with its password (or a lone user, a token)
    replaced by ****: https://me:tok@host/simple -> https://me:****@host/simple."""
    return " ".join(_mask_url(word) for word in text.split())


def _mask_url(word: str) -> str:
    try:
        parts = urlsplit(word)
    except ValueError:  # not a URL pip could read either: show nothing of it
        return MASK
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return word
    user, colon, _ = userinfo.partition(":")
    masked = f"{user}:{MASK}" if colon else MASK
    return urlunsplit(parts._replace(netloc=f"{masked}@{host}"))
