"""The one error type mmplan raises for bad input: the CLI prints its message on one line and exits 2."""


class MmplanError(Exception):
    """A problem the user can fix (bad file, bad option, impossible request); message is one sentence."""


class FormatError(MmplanError):
    """A profile, plan or cluster file that is malformed, of the wrong schema version or inconsistent."""
