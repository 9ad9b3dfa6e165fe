"""pdserve: disaggregated prefill/decode LLM serving.

`pdserve` is the one import name this distribution installs. Its subpackages are the
repository's top-level folders: `pdserve.router` is `router/`, `pdserve.kernels` is `kernels/`,
and so on (docs/architecture.md has the map). A wheel puts them under `pdserve/` (setuptools'
package-dir in pyproject.toml); in a source checkout this package's path also covers the
checkout's root, so the same names resolve to the folders in place. The folders themselves carry
no `__init__.py`: a bare `import kernels` or `import router` can never find them before another
distribution of that name (Hugging Face's `kernels`, say), even from the checkout's root.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.2.0"

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "kvtransfer").is_dir():
    __path__.append(str(_CHECKOUT))  # type: ignore[name-defined]  # noqa: F821
