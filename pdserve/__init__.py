"""pdserve: disaggregated prefill/decode LLM serving.

`pdserve` is the one import name this distribution installs. Its subpackages are the
repository's top-level folders: `pdserve/router` is a link to `router/`, `pdserve/kernels` to
`kernels/`, and so on (docs/architecture.md has the map), so mypy, pyright and an editor find
`pdserve.router.app` at `pdserve/router/app.py` like any other package, and a wheel holds the
folders' files under `pdserve/`. A folder is never importable under its bare name
(pdserve/_bare_name.py): `import kernels` stays Hugging Face's.
"""

__version__ = "0.2.0"
