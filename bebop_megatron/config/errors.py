"""The configuration's user-error type (its own module so that every config module can raise it)."""


class ConfigError(ValueError):
    """A user error in the configuration; the message names the field."""

    same_on_every_rank = True
    """Every rank checks the same config and files alike (or agreed on the error), so only
    rank 0 prints it (:func:`bebop_megatron.cli.run_cli`)."""
