"""The errors a user meets at start: a config that cannot work. Every package raises it; its
message says what to change. Kept tiny so that any module may import it."""


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


def require(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless ok: the settings modules' checks read as a list of rules."""
    if not ok:
        raise ConfigError(message)
