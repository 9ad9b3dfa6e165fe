"""The distribution installs one import name, `pdserve`, and leaves every other name free."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers.paths import REPO, package_folders

ROOT = REPO
PACKAGES = package_folders()


def run_python(code: str, cwd: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, *args, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (a build writes build/ and *.egg-info beside them)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "pdserve", src / "pdserve", symlinks=True, ignore=ignore)
    for folder in PACKAGES.values():
        shutil.copytree(folder, src / folder.name, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, timeout=300, capture_output=True)
    (whl,) = out.glob("pdserve-*.whl")
    return whl


def test_hugging_face_kernels_keeps_its_import_name_even_from_the_checkout_root():
    where = run_python("import kernels; print(kernels.__file__)", ROOT)
    assert where != "None" and Path(where).resolve().is_relative_to(Path(sysconfig.get_paths()["purelib"]).resolve())
    assert run_python("import kernels, transformers; print(hasattr(kernels, 'get_kernel'))", ROOT) == "True"


def test_pdserve_kernels_is_the_kernels_folder():
    where = run_python("import pdserve.kernels.reference as r; print(r.__file__)", ROOT)
    assert Path(where).resolve() == ROOT / "kernels" / "reference.py"


def module_names_by_file() -> dict[Path, list[str]]:
    """Every module of the checkout's `pdserve` package, by the file it is (links resolved)."""
    code = ("import pkgutil, pdserve, importlib.util\n"
            "print('pdserve', pdserve.__file__)\n"
            "for m in pkgutil.walk_packages(pdserve.__path__, 'pdserve.'):\n"
            "    print(m.name, importlib.util.find_spec(m.name).origin)")
    names: dict[Path, list[str]] = {}
    for line in run_python(code, ROOT).splitlines():
        name, origin = line.split()
        names.setdefault(Path(origin).resolve(), []).append(name)
    return names


def test_every_source_file_is_one_module_of_pdserve():
    names = module_names_by_file()
    sources = {p.resolve() for p in (ROOT / "pdserve").glob("*.py")}
    sources |= {p.resolve() for folder in PACKAGES.values() for p in folder.rglob("*.py")}
    assert set(names) == sources
    assert {f: n for f, n in names.items() if len(n) != 1} == {}
    assert not any(n.startswith(("pdserve.pdserve", "pdserve.tests", "pdserve.docs")) for n in sum(names.values(), []))


@pytest.mark.parametrize("name", sorted(p.rsplit(".", 1)[1] for p in PACKAGES))
def test_no_folder_is_importable_under_its_bare_name_from_the_checkout_root(name):
    """From the root (on sys.path under `python -c`), a bare name is another distribution's, or an
    empty package with no file: none of pdserve's modules under a second name."""
    code = f"m = __import__({name!r})\nprint(getattr(m, '__file__', None), list(getattr(m, '__path__', [])))"
    where, path = run_python(code, ROOT).split(" ", 1)
    assert where == "None" and path == "[]" or not Path(where).resolve().is_relative_to(ROOT / name), where
    for module in sorted(p.stem for p in (ROOT / name).glob("*.py") if p.stem != "__init__"):
        out = subprocess.run([sys.executable, "-c", f"import {name}.{module}"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, f"{name}.{module} imported"


def test_a_library_probing_a_bare_name_from_the_checkout_root_sees_it_absent():
    """transformers asks whether `kernels` is installed by finding and importing it: run from the
    root where no other distribution owns the name (vLLM's server, say), it must see no package,
    not fail. `engine` stands in: nothing else is called that."""
    code = ("from transformers.utils.import_utils import _is_package_available\n"
            "print(_is_package_available('engine', return_version=True))")
    assert run_python(code, ROOT) == "(False, 'N/A')"


@pytest.mark.slow  # builds the wheel
def test_the_wheel_holds_every_package_under_pdserve_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"pdserve"}
    for package, folder in {"pdserve": ROOT / "pdserve", **PACKAGES}.items():
        sources = {p.relative_to(folder).as_posix() for p in folder.rglob("*.py")}
        inside = "/".join(package.split(".")) + "/"
        assert sources <= {n[len(inside):] for n in names if n.startswith(inside)}, package


def install_wheel(wheel: Path, tmp_path: Path) -> Path:
    """pip-install the wheel (no deps) into its own folder; return that folder."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    return target


@pytest.mark.slow  # builds the wheel
def test_the_wheel_holds_the_chat_page_and_the_installed_router_serves_it(wheel, tmp_path):
    static = sorted(p.name for p in (ROOT / "router" / "static").iterdir())
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"chat.html", "chat.js", "chat.css"} <= set(static)
    assert {f"pdserve/router/static/{n}" for n in static} <= names
    target = install_wheel(wheel, tmp_path)
    code = (f"import sys; sys.path[:0] = [{str(target)!r}, {sysconfig.get_paths()['purelib']!r}]; "
            "from pdserve.router.chat_page import ChatPage; print(*sorted(ChatPage().assets))")
    assert run_python(code, tmp_path, "-S", "-I").split() == static


@pytest.mark.slow  # builds the wheel
def test_the_wheel_holds_the_cpu_kernel_sources_where_the_builder_looks(wheel, tmp_path):
    sources = sorted(p.name for p in (ROOT / "kernels" / "csrc").glob("*.cpp"))
    assert sources, "kernels/csrc holds the CPU kernels"
    assert {f"pdserve/kernels/csrc/{n}" for n in sources} <= set(zipfile.ZipFile(wheel).namelist())
    target = install_wheel(wheel, tmp_path)
    code = (f"import sys; sys.path[:0] = [{str(target)!r}, {sysconfig.get_paths()['purelib']!r}]; "
            "from pdserve.kernels import cpu_ops; print(*(s.name for s in cpu_ops.SOURCES))")
    assert run_python(code, tmp_path, "-S", "-I").split() == sources


@pytest.mark.slow  # builds the wheel
def test_the_installed_wheel_imports_from_its_own_files(wheel, tmp_path):
    """Installed (no checkout on the path, no editable finder), `pdserve.*` resolves inside site."""
    target = install_wheel(wheel, tmp_path)
    deps = sysconfig.get_paths()["purelib"]
    code = (f"import sys; sys.path[:0] = [{str(target)!r}, {deps!r}]; "
            "import pdserve.kernels.reference as k, pdserve.router.app as a, pdserve.protocol.codec as c; "
            "print(k.__file__, a.__file__, c.__file__)")
    files = run_python(code, tmp_path, "-S", "-I").split()
    assert all(Path(f).is_relative_to(target) for f in files), files
