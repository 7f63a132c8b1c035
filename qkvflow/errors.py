"""Errors that a user, not a bug, causes: the CLI prints them as one paragraph, without a traceback."""


class UserError(Exception):
    """Bad input: a config key, a file, a checkpoint. The message names it and what was expected."""
