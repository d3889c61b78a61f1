"""`python -m engine.resolved`: the resolved config of each of several engine command lines,
as `--print-config` prints each, in one process. launch freezes a sweep's members at
submission with it: one torch start-up for the array, not one per member.

stdin: a JSON list of argument lists (`[RECIPE, --config FILE, key=value, ...]`); stdout: a
JSON list of YAML texts, in order. A refused request is the engine's one line on stderr and
exit 2, as for the engine's own command line.

`--compare`: stdin a JSON list of `[argument list, saved request file]` pairs; stdout, for
each, the differences that make the request another one than the file's (one run name, one
request: engine.config.identity), the training's length included (a sweep's cell pools its
members). launch refuses to grow a sweep whose members would not train what they trained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine import cli
from engine import config as C
from engine.config import identity
from engine.tracking import redact


def resolved(argv: list[str]) -> str:
    """What `python -m engine.train ARGV --print-config` prints."""
    request = cli.parse_argv(argv)
    cfg, _ = cli.load(request)
    return redact(C.dump(cfg))


def changes(argv: list[str], saved_file: str) -> list[str]:
    """How the request ARGV resolves to differs from the saved request in saved_file."""
    cfg, recipe = cli.load(cli.parse_argv(argv))
    saved = identity.saved_request(Path(saved_file))
    if saved is None:
        return []
    current = redact(cfg.to_dict())  # as the saved files hold it
    return identity.request_changes(saved, current, recipe.resume_safe, identity.LENGTH_KEYS)


def main() -> int:
    try:
        given = json.load(sys.stdin)
        if "--compare" in sys.argv[1:]:
            out = [changes([str(w) for w in argv], str(saved)) for argv, saved in given]
        else:
            out = [resolved([str(word) for word in argv]) for argv in given]
    except C.ConfigError as err:
        print(f"error: {redact(cli.one_line(err))}", file=sys.stderr)
        return 2
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
