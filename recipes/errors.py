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


def from_hydra(err: BaseException, conf_dir: str | None = None) -> ConfigError:
    """A Hydra or OmegaConf error at composition (a typo'd key, an unknown group option, a value of the
    wrong type, an override Hydra cannot parse) as a refusal that names the option and the fix.
    ``conf_dir``: where the groups' options live, to list them (nested groups such as
    ``recompute/selective`` included, which Hydra's own list leaves out)."""
    import dataclasses
    import difflib
    from pathlib import Path

    cause = err
    while cause.__cause__ is not None and getattr(cause, "full_key", None) is None:
        cause = cause.__cause__
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    missing = getattr(err, "missing_cfg_file", None)
    if missing and "/" in missing:  # model=mooe: an option the group does not have
        group, option = missing.split("/", 1)  # recompute=selective/nope: options under recompute/selective
        where = Path(conf_dir or ".") / missing.rsplit("/", 1)[0]
        found = sorted(str(p.relative_to(Path(conf_dir or ".") / group).with_suffix("")) for p in where.glob("*.yaml"))
        options = found if conf_dir and found else list(getattr(err, "options", None) or [])
        near = difflib.get_close_matches(option, options, n=1)
        hint = f"did you mean {group}={near[0]}? " if near else ""
        return ConfigError(f"{group}={option}", f"{group} has no option {option!r}",
                           f"{hint}options: {', '.join(options)} (python train.py --help lists every group)")
    key = getattr(cause, "full_key", None)
    if key and isinstance(cause, (AttributeError, KeyError)):  # model.hiden_size=3: not a setting
        schema = getattr(cause, "object_type", None)
        known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
        near = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
        section = key.rsplit(".", 1)[0] + "." if "." in key else ""
        hint = f"did you mean {section}{near[0]}? " if near else ""
        return ConfigError(key, "is not a setting", f"{hint}check the spelling (python train.py --cfg job prints "
                           "every setting with its value)")
    if key:  # model.num_layers=abc: a value of the wrong type
        kind = first.rsplit(" ", 1)[-1] if "converted to" in first else "value of the schema's type"
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        return ConfigError(key, first, f"give {key} {article} {kind.lower()} (python train.py --cfg job shows "
                           "its current value)")
    override = getattr(err, "override", None)  # OverrideParseException: which one, when its message does not say
    if override and override not in first:
        first = f"{override!r}: {first}"
    return ConfigError("overrides", first, "write each override as key=value or group=option (quote values with "
                       "spaces, brackets or commas; python train.py --help lists the groups)")
