"""The wheel's one build step beyond pyproject.toml: the CPU kernels, compiled ahead.

Where torch is importable in the build environment, the wheel holds a library of the CPU kernels
for each instruction-set variant (kernels/variants.py, compiled by kernels/build.py), and a
machine that installs it loads the best one its CPU runs without a compiler (kernels/cpu_ops.py).
Build it without isolation once the CPU torch is installed (an isolated build would download
torch's CUDA build, gigabytes, to compile against):

    pip wheel --no-deps --no-build-isolation -w dist .
    pip wheel --no-deps --no-build-isolation -C--build-option=--cpu-variants=best -w dist .

`--cpu-variants` takes all (the default), best (this CPU's), none, or names separated by commas.
Without torch the wheel is pure Python, with a warning (an error where --cpu-variants asked for
kernels): the kernels then compile on the machine that runs them, on first use. An editable
install never compiles them.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.errors import OptionError

ROOT = Path(__file__).resolve().parent
KERNELS = ("pdserve", "kernels")  # where the libraries go in the wheel


def _kernel_build():
    """kernels/build.py from this source tree (a PEP 517 build does not put the tree on sys.path)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pdserve.kernels import build

    return build


class KernelDistribution(Distribution):
    """A wheel with compiled kernels is a platform wheel: its files go to platlib."""

    compiled_kernels = False

    def has_ext_modules(self) -> bool:
        return self.compiled_kernels or super().has_ext_modules()


class BuildPyWithKernels(build_py):
    """build_py, then the CPU kernel variants that bdist_wheel asked for into the built package."""

    cpu_variants: list[str] = []

    def run(self) -> None:
        super().run()
        if not self.cpu_variants or self.editable_mode:
            return
        build = _kernel_build()
        temp = Path(self.get_finalized_command("build").build_temp) / "pdserve-kernels"
        out = Path(self.build_lib, *KERNELS)
        self.announce(f"compiling the CPU kernels: {', '.join(self.cpu_variants)}", level=2)
        build.build(self.cpu_variants, out, build_dir=temp)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.cpu_variants and not self.editable_mode:
            build = _kernel_build()
            out = Path(self.build_lib, *KERNELS)
            outputs += [str(out / build.library_name(v)) for v in self.cpu_variants]
            outputs.append(str(out / build.MANIFEST))
        return outputs


class BdistWheelWithKernels(bdist_wheel):
    """bdist_wheel with `--cpu-variants`; a wheel with kernels is tagged py3-none-<platform>: the
    libraries depend on the platform and torch, not on Python's version."""

    user_options = [*bdist_wheel.user_options,
                    ("cpu-variants=", None, "CPU kernel variants to compile: all, best, none, or a list")]

    def initialize_options(self) -> None:
        super().initialize_options()
        self.cpu_variants: str | None = None  # all where torch is importable, else none

    def finalize_options(self) -> None:
        variants: list[str] = []
        asked = self.cpu_variants
        editable = "editable_wheel" in self.distribution.commands  # which runs the sources in place
        if asked != "none" and not editable:
            if importlib.util.find_spec("torch") is not None:
                variants = _kernel_build().resolve(asked or "all")
            elif asked is not None:
                raise OptionError(f"--cpu-variants={asked} needs torch in the build environment: install the "
                                  "CPU torch first and build with --no-build-isolation")
            else:
                warnings.warn("torch is not importable in this build environment: the wheel holds no "
                              "compiled CPU kernels, and they will compile where they first run "
                              "(build with --no-build-isolation after installing the CPU torch)", stacklevel=1)
        self.distribution.get_command_obj("build_py").cpu_variants = variants  # type: ignore[attr-defined]
        self.distribution.compiled_kernels = bool(variants)  # type: ignore[attr-defined]
        super().finalize_options()

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(distclass=KernelDistribution, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": BdistWheelWithKernels})
