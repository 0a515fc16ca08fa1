"""Errors that the command line turns into one-line messages and exit codes.

Exit codes: 0 success, 1 a check or verification failed under ``--strict``,
2 bad usage or bad input.  Anything else escaping the CLI is an internal error.
"""

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class QnnPassesError(Exception):
    """Base class of every error qnnpasses reports to the user."""

    exit_code = EXIT_INTERNAL


class BadInputError(QnnPassesError):
    """The model, a data file or an argument is unusable; the message names it."""

    exit_code = EXIT_BAD_INPUT


class PipelineSpecError(BadInputError):
    """A textual pipeline could not be parsed or names an unknown pass/option."""


class CheckFailedError(QnnPassesError):
    """A pass broke the graph check or the numerical tolerance under --strict."""

    exit_code = EXIT_CHECK_FAILED


class BackendUnavailableError(QnnPassesError):
    """The QNN HTP backend (onnxruntime-qnn) is not installed or cannot start."""

    exit_code = EXIT_BAD_INPUT
