"""launch.container: the docker settings of a request, from the environment, and the image
build's site settings (base, CA bundle, pip's index), whose credentials are never shown."""

import shlex

import pytest

from launch import cli
from launch.container import build_note, docker_settings, mask_credentials
from launch.errors import UserError
from launch.render import Docker

TOKEN = "tok-3xample-5ecret"


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        (f"https://me:{TOKEN}@pypi.example.org/simple", "https://me:****@pypi.example.org/simple"),
        (f"https://{TOKEN}@host:8443/s", "https://****@host:8443/s"),
        ("https://pypi.example.org/simple", "https://pypi.example.org/simple"),
        (f"http://a/s http://u:{TOKEN}@b/s", "http://a/s http://u:****@b/s"),
        ("pypi.example.org", "pypi.example.org"),  # a trusted host, no URL
    ],
)
def test_credentials_in_index_urls_are_masked(given, shown):
    assert mask_credentials(given) == shown


def test_the_build_settings_come_from_the_environment_for_image_only(tmp_path):
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    env = {
        "DOCKER": "/usr/bin/docker",
        "DOCKER_NETWORK": "host",
        "BASE_IMAGE": "recipes-base:bookworm",
        "CA_BUNDLE": str(bundle),
        "PIP_INDEX_URL": f"https://me:{TOKEN}@mirror/simple",
        "PIP_EXTRA_INDEX_URL": "",  # empty: not passed
    }
    assert docker_settings(env, "image") == Docker(
        client="/usr/bin/docker", network="host", base_image="recipes-base:bookworm",
        ca_bundle=str(bundle), pip_settings=("PIP_INDEX_URL",),
    )  # fmt: skip
    assert docker_settings(env | {"CA_BUNDLE": "/missing"}, "docker") == Docker(
        client="/usr/bin/docker", network="host"
    )
    assert docker_settings(env | {"DOCKER_NETWORK": "bad name"}, "local") == Docker()
    (note,) = build_note(docker_settings(env, "image"), env)
    assert TOKEN not in note and "https://me:****@mirror/simple" in note


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("CA_BUNDLE", "/no/such/ca.pem", "is not a readable file"),
        ("DOCKER_NETWORK", "host; rm -rf x", "is not a docker network name"),
        ("BASE_IMAGE", "base image", "is not an image reference"),
        ("DOCKER", "--help", "is not a program"),
    ],
)
def test_a_bad_build_setting_is_one_line_naming_it(name, value, says):
    with pytest.raises(UserError, match=says) as caught:
        docker_settings({name: value}, "image")
    assert name in str(caught.value) and "\n" not in str(caught.value)


def test_make_image_dry_run_never_shows_the_index_credential(tmp_path, capsys):
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    env = {
        "IMAGE": "recipes:x",
        "CA_BUNDLE": str(bundle),
        "PIP_EXTRA_INDEX_URL": f"https://ci:{TOKEN}@mirror.example.org/simple",
        "PIP_TRUSTED_HOST": "mirror.example.org",
    }
    assert cli.main(["image", "--dry-run"], env) == 0
    out, err = capsys.readouterr()
    assert TOKEN not in out + err
    argv = shlex.split(out)
    assert "id=pip_extra_index_url,env=PIP_EXTRA_INDEX_URL" in argv
    assert f"id=ca_bundle,src={bundle}" in argv
    assert "https://ci:****@mirror.example.org/simple" in err


def test_make_image_without_the_docker_client_is_one_line(capsys):
    env = {"IMAGE": "recipes:x", "DOCKER": "no-such-docker-client"}
    assert cli.main(["image"], env) == 2
    assert "no-such-docker-client is not on PATH" in capsys.readouterr().err


def test_a_blank_pip_setting_is_unset_and_the_build_note_is_a_note_line():
    """PIP_EXTRA_INDEX_URL=' ' gives the build no secret (and no note of an empty value); a
    set one is said on a `launch: note:` line, as the fuzz of request variables expects."""
    assert docker_settings({"PIP_EXTRA_INDEX_URL": " "}, "image").pip_settings == ()
    env = {"PIP_INDEX_URL": "https://mirror/simple"}
    (note,) = build_note(docker_settings(env, "image"), env)
    assert note.startswith("launch: note: image: PIP_INDEX_URL=https://mirror/simple")
