"""Errors that a user, not a bug, causes: the CLI prints them as one paragraph, without a traceback."""


class UserError(Exception):
    """Bad input: a config key, a file, a checkpoint. The message names it and what was expected."""


class ConfigError(UserError, ValueError):
    """A config value outside what the model or solver accepts."""


def check(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: expected {expected}")
