"""Where the tests find the checkout: its root, and the folders tests read or run from."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def package_folders() -> dict[str, Path]:
    """`pdserve.<name>` -> its folder, for every link pdserve/<name> -> <name>/ (the subpackages)."""
    return {f"pdserve.{p.name}": p.resolve() for p in sorted((REPO / "pdserve").iterdir()) if p.is_symlink()}
