"""`InvalidRequestError`: a bad value, named by its field, whether it came in a request, a flag or a
configuration. The API turns it into OpenAI's 400 (`param` is the field), the CLI into one line naming
the flag."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A value is invalid. `param` names the offending field (OpenAI's `param`, or the option's name)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
