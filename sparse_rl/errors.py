"""The two error kinds every stage raises; the CLI maps them to exit codes 2 and 1."""


class SparseRLError(Exception):
    """A runtime failure (bad file contents, a missing model, a failed run): exit code 1.

    The message is one line that names the file, line or flag and says what to do.
    """

    exit_code = 1


class UsageError(SparseRLError):
    """Bad command-line usage or configuration (unknown key, bad flag value): exit code 2."""

    exit_code = 2
