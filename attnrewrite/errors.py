"""Errors a user can act on. The CLI prints ``str(error)`` as its one line; anything else is a bug.
An error a rewrite run raises (attnrewrite.pipeline.run, and so attnrewrite.rewrite) carries the
run's report as ``error.report`` (record.Report); pipeline.ending says which outcome it is."""

import os


class AttnRewriteError(Exception):
    """Bad input or an output that failed a validation gate; the message is one clear line."""


class NothingToRewrite(AttnRewriteError):
    """No site could be rewritten; carries the record so callers can say why."""

    def __init__(self, message: str, record):
        super().__init__(message)
        self.record = record


class NothingRewritten(UserWarning):
    """The Python API returned the model unchanged: no site could be rewritten. ``report``: the
    run's (record.Report, outcome "refused"; None for torch models)."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class RewriteFailed(AttnRewriteError):
    """The input was fine but the result is not: the rewritten model failed a validation gate,
    or writing it failed part-way. Nothing was written (exit 1, not 2)."""


class InputFails(AttnRewriteError):
    """The input model itself does not run on the inputs the gates run the rewritten model
    on: bad input (exit 2), the rewrite must not take the blame."""


def require_file(path, kind: str) -> None:
    """One line where ``path`` names no file to read: missing, or a directory (``kind`` says what
    was expected there, such as "a tokenizer.json")."""
    if os.path.isdir(path):
        raise AttnRewriteError(f"{path}: is a directory, not {kind}")
    if not os.path.isfile(path):
        raise AttnRewriteError(f"{path}: no such file")
