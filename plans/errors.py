"""The one error type mmplan raises for bad input: the CLI prints its message on one line and exits 2."""


class MmplanError(Exception):
    """A problem the user can fix (bad file, bad option, impossible request); message is one sentence."""


class FormatError(MmplanError):
    """A profile, plan or cluster file that is malformed, of the wrong schema version or inconsistent."""


class ImpossiblePrediction(MmplanError):
    """The cost model's figures for a plan are impossible (MFU > 1, a negative time): the profile's measured times or
    the cluster's peak are wrong. Never a reason to skip a candidate plan: every plan of such inputs is suspect."""
