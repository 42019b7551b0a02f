"""The one base class of prefpack's user errors (a wrong file, value or setup, told as a message).

Torch-free and importing nothing, so that the CLI can catch every user error without loading the modules that
raise them. Each error also keeps its builtin base (``ValueError``, ``OSError``) so ``except ValueError`` still
catches it.
"""


class PrefpackError(Exception):
    """A user error: the CLI prints its message without a traceback and exits with status 2."""
