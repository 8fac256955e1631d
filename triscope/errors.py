"""Exception types whose message is a one-line, user-facing explanation."""


class TriscopeError(Exception):
    """Base class: the CLI prints the message on one line and exits non-zero."""


class InputError(TriscopeError):
    """A file or payload could not be parsed; the message names the source and the position."""


class StoreError(TriscopeError):
    """The store is unreachable or rejected a statement."""


class ConfigError(TriscopeError):
    """The configuration file or an environment override is invalid."""
