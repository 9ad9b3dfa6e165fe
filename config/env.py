"""Option defaults from the environment: `--foo-bar` reads PDSERVE_FOO_BAR (torch-free, so the
router and the benchmark can use it without loading the model runtime)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_TRUE = {"1", "true", "yes", "on"}


def env_default(option: str, default: Any, conv: Callable[[str], Any] | None = None) -> Any:
    """PDSERVE_<OPTION> converted to `conv` (or the default's type) when set, else `default`."""
    name = "PDSERVE_" + option.upper().replace("-", "_")
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if conv is None:
        conv = type(default) if isinstance(default, bool | int | float) else str
    if conv is bool:
        return raw.strip().lower() in _TRUE
    try:
        return conv(raw)
    except ValueError as e:
        raise SystemExit(f"{name}={raw!r} is not valid for --{option.replace('_', '-').lower()}: {e}") from None


def add_env_argument(group: Any, flag: str, default: Any, help: str, **kw: Any) -> None:
    """`group.add_argument(flag, ...)` whose default is $PDSERVE_<FLAG> when set, else `default`;
    an int or float default gives the flag its type unless `type=` says otherwise."""
    if "type" not in kw and isinstance(default, int | float) and not isinstance(default, bool):
        kw["type"] = type(default)
    group.add_argument(flag, default=env_default(flag.removeprefix("--"), default, kw.get("type")), help=help, **kw)
