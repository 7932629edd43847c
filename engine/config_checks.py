"""Value checks shared by the YAML run config's sections, and the published deployment minimums.

DeepSeek-V4's combination checks, which read a whole ``RunConfig``, are in ``engine.run_config``.

Every failure is a ``ConfigError`` whose message starts with the full key path
(``scheduler_config.block_size: ...``), as ``engine.run_config`` promises.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import ConfigError

# Published minimum deployment units, in chips, of the full-size models (by hidden_size) per Ascend
# generation (reference/peers.md, "Minimum deployment units"): 950PR/DT Flash 4, Pro 16; A3 Flash
# (INT8) 4, Pro (INT8-INT4) 32. A rank is one device: an Atlas A3 chip (Ascend 910C) is two dies of
# 64 GB, each its own device and rank; an A2 (910B) or 950 chip is one.
MIN_CHIPS = {("A3", 4096): 4, ("A3", 7168): 32, ("950", 4096): 4, ("950", 7168): 16}
RANKS_PER_CHIP = {"A2": 1, "A3": 2, "950": 1}
MODEL_NAMES = {4096: "DeepSeek-V4-Flash", 7168: "DeepSeek-V4-Pro"}


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, for the dataclass fields only."""
    resolved = typing.get_type_hints(cls)
    return {f.name: resolved[f.name] for f in dataclasses.fields(cls)}


def fail(obj: Any, name: str, msg: str) -> typing.NoReturn:
    """Raise ConfigError for field ``name`` of section ``obj`` (message prefixed by the key path)."""
    raise ConfigError(f"{obj._PATH}.{name}: {msg}")


def positive(obj: Any, name: str, optional: bool = False) -> None:
    """The field must be a positive integer (or None when ``optional``). Raises ConfigError."""
    v = getattr(obj, name)
    if not (optional and v is None) and v <= 0:
        fail(obj, name, f"must be a positive integer{' or null' if optional else ''}, got {v}")


def in_range(obj: Any, name: str, lo: int, hi: int) -> None:
    """The field must lie in [lo, hi]. Raises ConfigError."""
    v = getattr(obj, name)
    if not lo <= v <= hi:
        fail(obj, name, f"must be in [{lo}, {hi}], got {v}")


def choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    """The field must be one of ``choices`` (with a "did you mean" hint). Raises ConfigError."""
    v = getattr(obj, name)
    if v not in choices:
        close = difflib.get_close_matches(v, choices, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        fail(obj, name, f"must be one of {', '.join(map(repr, choices))}, got {v!r}{hint}")


def type_name(v: Any) -> str:
    """The YAML-facing type name of a value ("null" for None)."""
    return "null" if v is None else type(v).__name__


def show(v: Any) -> str:
    """A value and its type for an error message."""
    return f"{v!r} ({type_name(v)})"


def unknown_key_hint(key: Any, known: Any, homes: Mapping[str, type], section: str | None = None,
                     top_level: bool = False) -> str:
    """' (did you mean ...?)' for an unknown key: the same key in another of ``homes`` (section path
    -> its dataclass) when ``section`` is one of them or the key is top-level, else a close name
    among ``known``, else the known names."""
    if not isinstance(key, str):
        return f" (keys must be strings, got {type_name(key)})"
    if top_level or section in homes:   # a key put in the wrong section
        found = [s for s, cls in homes.items() if s != section and key in field_hints(cls)]
        if found:
            return f" (did you mean {found[0]}.{key}?)"
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f"; known: {', '.join(sorted(known))}"


def coerce(path: str, value: Any, hint: Any, section: Callable[[type, Any, str], Any]) -> Any:
    """``value`` of the field at key ``path`` checked against its annotation ``hint`` and normalised
    (int -> float; a mapping -> its section dataclass, built by ``section(cls, raw, path)``).
    Raises ConfigError naming ``path``."""
    args = typing.get_args(hint)
    if type(None) in args:                                  # X | None
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else section(hint, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {show(value)}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {show(value)}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{path}: must be a finite number, got {show(value)}")
        return float(value) if type(value) is not float else value
    elif hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {show(value)}")
    elif typing.get_origin(hint) is dict:                   # dict[str, str]
        if value is None:
            return {}
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in value.items()):
            raise ConfigError(f"{path}: must be a mapping of strings to strings, got {show(value)}")
        return dict(value) if type(value) is not dict else value
    elif typing.get_origin(hint) is list:                   # list[int]
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{path}: must be a list of integers, got {show(value)}")
        return list(value)                                  # not the caller's list
    else:  # pragma: no cover - a field type this module does not know
        raise TypeError(f"{path}: unsupported field type {hint!r}")
    return value


def min_ranks(hidden_size: int, version: str | None) -> tuple[int, int] | None:
    """(chips, ranks) of the published minimum for a full-size model (``hidden_size`` 4096: Flash,
    7168: Pro) on Ascend generation ``version`` (None: "A3", the default platform); None when there
    is none (the tiny models, A2)."""
    v = version or "A3"
    chips = MIN_CHIPS.get((v, hidden_size))
    return None if chips is None else (chips, chips * RANKS_PER_CHIP[v])
