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


def install_hint(extra: str) -> str:
    """The command that installs an optional part (an extra of pyproject.toml), as run in captioner's folder: the
    package is installed from its clone, and not from an index."""
    return f"run `make install` in captioner's folder, or `pip install -e '.[{extra}]'` there"
