"""Launch settings: validation of what the user asked for, before anything starts.

The decorator, ``with_overrides`` and (later) the cell magic all go through
:func:`make_settings`, so a setting is checked the same way everywhere and a
mistake surfaces at decoration time, not minutes into a run.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from air_magic.errors import ConfigurationError
from air_magic.launch.accelerators import AcceleratorSpec, AcceleratorType, parse_accelerator_type
from air_magic.user_warnings import warn_at_user_line

DEFAULT_TIMEOUT = 10800.0  # the seed's 3 hours
DEFAULT_MAX_PAYLOAD_BYTES = 512 * 2**20
DISPLAY_MODES = ("auto", "tabs", "text", "rank0", "none")

_UNSET: Any = object()


@dataclass(frozen=True)
class LaunchSettings:
    """Validated settings of one decorated function. Immutable; copy with overrides."""

    num_accelerators: int | None = None
    accelerator_type: AcceleratorSpec | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    display: str = "auto"
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    tracking: bool = True
    warm_start: bool = True
    experiment: str | None = None
    run_name: str | None = None

    # The user's own spelling of every setting, so overrides re-validate as one.
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


def make_settings(base: Mapping[str, Any] | None = None, **given: Any) -> LaunchSettings:
    """Validate ``given`` (keyword settings, legacy names allowed) on top of ``base``."""
    given = {k: v for k, v in given.items() if v is not _UNSET}
    given = _translate_legacy(given)
    raw = {**(base or {}), **given}
    unknown = set(raw) - _FIELDS
    if unknown:
        raise ConfigurationError(
            f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FIELDS))}"
        )
    return LaunchSettings(
        num_accelerators=_check_count(raw.get("num_accelerators")),
        accelerator_type=_check_type(raw.get("accelerator_type")),
        timeout=_check_timeout(raw.get("timeout", DEFAULT_TIMEOUT)),
        display=_check_display(raw.get("display", "auto")),
        env=_check_env(raw.get("env")),
        log_dir=_check_log_dir(raw.get("log_dir")),
        max_payload_bytes=_check_payload_limit(raw.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES)),
        tracking=_check_bool("tracking", raw.get("tracking", True)),
        warm_start=_check_bool("warm_start", raw.get("warm_start", True)),
        experiment=_check_name("experiment", raw.get("experiment")),
        run_name=_check_name("run_name", raw.get("run_name")),
        raw=raw,
    )


_FIELDS = {
    "num_accelerators",
    "accelerator_type",
    "timeout",
    "display",
    "env",
    "log_dir",
    "max_payload_bytes",
    "tracking",
    "warm_start",
    "experiment",
    "run_name",
}
_LEGACY_NAMES = {"gpus": "num_accelerators", "gpu_type": "accelerator_type"}


def _translate_legacy(given: dict[str, Any]) -> dict[str, Any]:
    """Map ``gpus``/``gpu_type`` and legacy type values to today's names, with one FutureWarning."""
    out = dict(given)
    replacements: list[str] = []
    for old, new in _LEGACY_NAMES.items():
        if old not in out:
            continue
        value = out.pop(old)
        if value is None:
            continue
        if given.get(new) is not None:
            raise ConfigurationError(
                f"both {old}= and {new}= were given; {old} is the legacy name of {new}, use only {new}="
            )
        out[new] = value
        replacements.append(f"{old}= -> {new}=")
    accel = out.get("accelerator_type")
    if accel is not None and not isinstance(accel, AcceleratorType):
        spec = _check_type(accel)
        if spec is not None and spec.legacy:
            from air_magic.launch.accelerators import LEGACY_TYPES

            replacements.append(f"{str(accel)!r} -> {LEGACY_TYPES[str(accel).strip().lower()]!r}")
    if replacements:
        warn_at_user_line(
            "air_magic: legacy setting(s) used; they still work but will be removed: "
            + "; ".join(replacements),
            FutureWarning,
        )
    return out


def _check_count(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ConfigurationError(f"num_accelerators must be a positive integer or None, got {value!r}")
    return int(value)


def _check_type(value: Any) -> AcceleratorSpec | None:
    if value is None:
        return None
    if isinstance(value, AcceleratorSpec):
        return value
    if not isinstance(value, str):
        raise ConfigurationError(f"accelerator_type must be a string such as 'GPU_8xH100', got {value!r}")
    return parse_accelerator_type(value)


def _check_timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(
            f"timeout must be a number of seconds (or None to disable it), got {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"timeout must be a finite number of seconds greater than 0 (or None to disable it), "
            f"got {value!r}"
        )
    return seconds


def _check_display(value: Any) -> str:
    if value not in DISPLAY_MODES:
        raise ConfigurationError(f"display must be one of {', '.join(DISPLAY_MODES)}, got {value!r}")
    return str(value)


def _check_env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigurationError("env must be a mapping of str to str (extra environment for every rank)")
    return dict(value)


def _check_log_dir(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"log_dir must be a path, got {value!r}")
    return os.fspath(value)


def _check_payload_limit(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ConfigurationError(f"max_payload_bytes must be a positive integer, got {value!r}")
    return int(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def _check_name(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{name} must be a non-empty string, got {value!r}")
    return value
