"""User errors of the converters: one line, raised as ``ValueError`` (exit status 2 in the CLIs)."""


class ConvertError(ValueError):
    """A conversion that cannot proceed; the message says what and why in one line."""
