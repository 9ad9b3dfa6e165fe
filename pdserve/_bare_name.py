"""A top-level folder of the checkout is pdserve's only as `pdserve.<folder>`.

`pdserve/<folder>` is a link to the checkout's `<folder>/`, so every tool maps `pdserve.router` to
`router/` by the directory tree alone. From the checkout's root (on `sys.path` under `python -c`,
`python -m` and pytest), `router/` would also be importable as a bare `router`: the same file
twice, or Hugging Face's `kernels` shadowed by ours. Each folder's `__init__.py` calls
`refuse_bare_import(__name__)` first, which hands a bare name to the distribution that owns it
elsewhere on `sys.path`, or fails as if the folder were not there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def refuse_bare_import(name: str) -> None:
    """Return if `name` is `pdserve.<folder>`; otherwise import another owner of that top-level
    name in its place (`sys.modules[name]`), or raise ModuleNotFoundError."""
    if name.startswith("pdserve."):
        return
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        del sys.modules[name]
        raise ModuleNotFoundError(
            f"No module named {name!r}: the checkout's {name}/ folder is imported as pdserve.{name}",
            name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import statement returns what sys.modules holds after this
    spec.loader.exec_module(module)
