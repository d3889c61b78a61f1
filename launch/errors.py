"""The one error type of the CLI: a mistake in the request, told in one line."""


class UserError(Exception):
    """Printed as `launch: <message>` on stderr; the process exits with `code` (2 by default)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def printable(text: str) -> str:
    """Control characters escaped as repr writes them: a value with a line break or a terminal
    escape sequence cannot split a message or hide part of it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
