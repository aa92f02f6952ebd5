"""Errors caused by the user's input (a config, a file, a checkpoint), shown as one line, never as a traceback."""


class CaptionerError(Exception):
    """Base class: the command-line entry point prints these as `error: <message>` and exits with status 2."""


class ConfigError(CaptionerError, ValueError):
    """An invalid setting: an unknown backbone name, a negative weight, a missing config file."""


class WeightsUnavailableError(CaptionerError, RuntimeError):
    """Pretrained weights are neither cached locally nor downloadable."""
