"""One error hierarchy for the whole agent."""
from __future__ import annotations

from collections.abc import Iterable


class ForwarderError(Exception):
    """Base class of every error the agent raises on purpose."""


class ConfigError(ForwarderError):
    """The configuration is invalid; carries every problem found, not just the first."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


class UsageError(ConfigError):
    """The command line is wrong (an option, an argument): exit 2 like a config error, but labelled usage."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        Exception.__init__(self, "usage: " + "; ".join(self.problems) + " (see sefwd COMMAND --help)")


class StartError(ForwarderError):
    """Something the agent needs at start is not there (a port in use, a file it cannot write): exit 1, not 2."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("cannot start:\n" + "\n".join(f"  - {p}" for p in self.problems))


class DocumentError(ForwarderError):
    """An IMDS Scheduled Events document could not be understood."""


class ImdsError(ForwarderError):
    """IMDS could not be reached or answered with an error status."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = True,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after


class ImdsTimeout(ImdsError):
    """IMDS did not answer in time: the connect or the whole answer ran past its deadline."""


class ImdsUnreachable(ImdsError):
    """Nothing answered at the IMDS address: refused, no route, or a name that does not resolve.

    Real IMDS never refuses a connection, so this names a wrong endpoint at once rather than
    looking like the slow first call (which is a timeout)."""


class StateError(ForwarderError):
    """The persisted state could not be read or written."""
