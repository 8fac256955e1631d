"""Exception types whose message is a one-line, user-facing explanation."""


class TriscopeError(Exception):
    """Base class: the CLI prints the message on one line and exits non-zero."""


class InputError(TriscopeError):
    """A file or payload could not be parsed; the message names the source and the position."""


class StoreError(TriscopeError):
    """The store is unreachable or rejected a statement."""


class ConfigError(TriscopeError):
    """The configuration file or an environment override is invalid."""


class SpoolUnavailable(TriscopeError):
    """The writer's spool cannot take rows now (disk full, out of file descriptors); nothing was
    queued: keep the rows and submit them again later."""


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty): every
    log line and error column that quotes an exception uses this, so a multi-line message (a chDB or
    HTTP traceback text) never spreads over several lines."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
