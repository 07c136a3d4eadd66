"""The project's refusals: one exception type that names the option to change and how."""

from __future__ import annotations


class ConfigError(ValueError):
    """A refused configuration: ``option`` is what to change, the message says how."""

    def __init__(self, option: str, problem: str, fix: str):
        self.option, self.problem, self.fix = option, problem, fix
        super().__init__(f"{option}: {problem}\n  fix: {fix}")


def check(cond: object, option: str, problem: str, fix: str) -> None:
    """Raise ``ConfigError(option, problem, fix)`` unless ``cond`` holds: every rule reads as a check."""
    if not cond:
        raise ConfigError(option, problem, fix)
