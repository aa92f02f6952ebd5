"""Errors caused by the user's input (a config, a file, a checkpoint), shown as one line, never as a traceback."""


class CaptionerError(Exception):
    """Base class: the command-line entry point prints these as `error: <message>` and exits with status 2."""


class ConfigError(CaptionerError, ValueError):
    """An invalid setting: an unknown backbone name, a negative weight, a missing config file."""


class WeightsUnavailableError(CaptionerError, RuntimeError):
    """Pretrained weights are neither cached locally nor downloadable."""


def check_choice(option: str, value, choices) -> None:
    """The one-line error for a setting that is not one of its `choices`."""
    if value not in choices:
        raise ConfigError(f"unknown {option} {value!r}; choose one of {', '.join(map(str, choices))}")
