"""`python -m engine.resolved`: the resolved config of each of several engine command lines,
as `--print-config` prints each, in one process. launch freezes a sweep's members at
submission with it: one torch start-up for the array, not one per member.

stdin: a JSON list of argument lists (`[RECIPE, --config FILE, key=value, ...]`); stdout: a
JSON list of YAML texts, in order. A refused request is the engine's one line on stderr and
exit 2, as for the engine's own command line."""

from __future__ import annotations

import json
import sys

from engine import cli
from engine import config as C
from engine.tracking import redact


def resolved(argv: list[str]) -> str:
    """What `python -m engine.train ARGV --print-config` prints."""
    request = cli.parse_argv(argv)
    cfg, _ = cli.load(request)
    return redact(C.dump(cfg))


def main() -> int:
    try:
        argvs = json.load(sys.stdin)
        texts = [resolved([str(word) for word in argv]) for argv in argvs]
    except C.ConfigError as err:
        print(f"error: {redact(cli.one_line(err))}", file=sys.stderr)
        return 2
    json.dump(texts, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
