"""A top-level folder of the checkout is pdserve's only as `pdserve.<folder>`.

`pdserve/<folder>` is a link to the checkout's `<folder>/`, so every tool maps `pdserve.router` to
`router/` by the directory tree alone. From the checkout's root (on `sys.path` under `python -c`,
`python -m` and pytest), `router/` would also be importable as a bare `router`: the same file
twice, or Hugging Face's `kernels` shadowed by ours. Each folder's `__init__.py` calls
`refuse_bare_import(__name__)` first, which hands a bare name to the distribution that owns it
elsewhere on `sys.path`, or else leaves an empty package in its place: no file, no version, no
submodule (`import router.app` fails), which is how a PEP 420 namespace folder without modules
looks. Libraries that probe an optional dependency by importing it (transformers asks for
`kernels`) then see it absent instead of failing on an error.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def refuse_bare_import(name: str) -> None:
    """Return if `name` is `pdserve.<folder>`; otherwise put another owner of that top-level name
    in its place (`sys.modules[name]`), or an empty package where there is none."""
    if name.startswith("pdserve."):
        return
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        empty = types.ModuleType(name, f"pdserve's {name}/ folder is imported as pdserve.{name}")
        empty.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        empty.__path__ = empty.__spec__.submodule_search_locations = []  # nothing in it: no submodule imports
        sys.modules[name] = empty  # the import statement returns what sys.modules holds after this
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
