"""The one error type of the CLI: a mistake in the request, told in one line."""


class UserError(Exception):
    """Printed as `launch: <message>` on stderr; the process exits with `code` (2 by default)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
