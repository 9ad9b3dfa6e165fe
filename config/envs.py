"""Every environment variable pdserve reads, and the only module that reads the environment.

Two kinds (tests/repo/test_settings.py fails on a read anywhere else):

- **Flag twins.** Every flag `--foo-bar` that a user may set defaults to $PDSERVE_FOO_BAR when
  that is set (`add_env_argument`, `flag_default`); declaring the flag registers its twin, so
  `--help` lists every setting and `pdserve up` passes each on as a flag. `pdserve env`
  prints them all.
- **Variables that are not flags**, in `VARIABLES` below: a secret that must not appear on a
  command line, and what other tools define.

Child processes get their environment from `child_environ`, not from `os.environ` directly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# name -> what it means. Nothing else but the flag twins is read.
VARIABLES: dict[str, str] = {
    "PDSERVE_SECRET": "the deployment secret itself (what `pdserve up` hands its children; "
                      "--secret-file is the flag, a secret never goes on a command line)",
    "TRITON_INTERPRET": "Triton's own: 1 runs Triton kernels on the CPU (tests and kernel_bench)",
    "TRITON_CACHE_DIR": "Triton's own: where it keeps compiled kernels; a worker sets it from --triton-cache",
}

_TRUE = {"1", "true", "yes", "on"}
_twins: dict[str, str] = {}  # PDSERVE_FOO_BAR -> --foo-bar, filled as flags are declared


def twin_of(option: str) -> str:
    """'--foo-bar' or 'foo-bar' -> 'PDSERVE_FOO_BAR'."""
    return "PDSERVE_" + option.removeprefix("--").upper().replace("-", "_")


def get(name: str) -> str | None:
    """The value of a registered variable (a `VARIABLES` entry or a declared flag's twin)."""
    if name not in VARIABLES and name not in _twins:
        raise KeyError(f"{name} is not a registered environment variable (config/envs.py)")
    return os.environ.get(name)


def flag_default(option: str, default: Any, conv: Callable[[str], Any] | None = None) -> Any:
    """The default of flag `--<option>`: $PDSERVE_<OPTION> converted to `conv` (or the default's
    type) when set and not empty, else `default`. Registers the twin."""
    name = twin_of(option)
    _twins[name] = "--" + option.removeprefix("--").replace("_", "-")
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
        raise SystemExit(f"{name}={raw!r} is not valid for --{option.removeprefix('--')}: {e}") from None


def add_env_argument(group: Any, flag: str, default: Any, help: str | None, **kw: Any) -> None:
    """`group.add_argument(flag, ...)` whose default is $PDSERVE_<FLAG> when set, else `default`;
    an int or float default gives the flag its type unless `type=` says otherwise."""
    if "type" not in kw and isinstance(default, int | float) and not isinstance(default, bool):
        kw["type"] = type(default)
    conv = bool if isinstance(default, bool) else kw.get("type")
    shown = f"{help} [env {twin_of(flag)}]" if help is not None else None
    group.add_argument(flag, default=flag_default(flag, default, conv), help=shown, **kw)


def child_environ(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a child process, with `extra` added and `drop` removed."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra or {})
    return env


def set_in_this_process(name: str, value: str) -> None:
    """Set a registered variable for this process and its children (a benchmark that turns on
    TRITON_INTERPRET before importing Triton, say)."""
    if name not in VARIABLES and name not in _twins:
        raise KeyError(f"{name} is not a registered environment variable (config/envs.py)")
    os.environ[name] = value


def registered() -> dict[str, str]:
    """Every variable pdserve reads: the twins of the flags declared so far, and `VARIABLES`."""
    return {**{name: f"the default of {flag}" for name, flag in sorted(_twins.items())}, **VARIABLES}
