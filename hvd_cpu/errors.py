"""The one exception type that means "the user's input is wrong", as opposed to a bug."""


class InputError(Exception):
    """Bad input: reported as one line (problem and fix) by rank 0, exit code 2, no traceback."""

    exit_code = 2
