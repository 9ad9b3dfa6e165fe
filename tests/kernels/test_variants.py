"""The CPU kernels' instruction-set variants (kernels/variants.py, kernels/build.py) and which one
a process loads (kernels/cpu_ops.py): the best prebuilt variant the CPU runs, the build for this
machine where none is installed, and a clear refusal of a variant the CPU cannot run or that is
not installed. Each variant's flags give the compiler the macros the kernels branch on."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.kernels import build, cpu_ops, variants
from tests.helpers.paths import REPO

V3 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
CPUS = {  # /proc/cpuinfo flags, as much of them as the choice reads
    "sapphire rapids": V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"},
    "zen 4": V4 | {"avx512_bf16", "avx512_vnni", "avx512_vbmi"},
    "ice lake": V4 | {"avx512_vnni", "avx512_vbmi"},
    "zen 3": V3 | {"sha_ni"},
    "sandy bridge": {"sse4_2", "avx"},
}
ALL = set(cpu_ops.VARIANTS)


def test_the_variants_go_best_first():
    assert cpu_ops.VARIANTS == ("amx", "avx512-bf16", "avx512", "avx2")


@pytest.mark.parametrize(("cpu", "picked"), [
    ("sapphire rapids", "amx"), ("zen 4", "avx512-bf16"), ("ice lake", "avx512"), ("zen 3", "avx2"),
    ("sandy bridge", "native"),
])
def test_auto_picks_the_best_installed_variant_the_cpu_runs(cpu, picked):
    assert cpu_ops.choose("auto", CPUS[cpu], ALL) == picked


def test_auto_takes_a_lesser_variant_where_the_best_is_not_installed():
    assert cpu_ops.choose("auto", CPUS["sapphire rapids"], {"avx512", "avx2"}) == "avx512"


def test_auto_builds_for_this_machine_where_nothing_is_installed():
    assert cpu_ops.choose("auto", CPUS["zen 4"], set()) == "native"
    assert cpu_ops.choose("auto", set(), ALL) == "native", "no /proc/cpuinfo: no prebuilt variant"


def test_a_variant_the_cpu_cannot_run_is_refused_with_what_it_lacks():
    with pytest.raises(RuntimeError, match=r"cannot run the 'amx' CPU kernels \(it lacks amx_bf16 amx_tile\); "
                                           r"it runs avx512-bf16, avx512, avx2"):
        cpu_ops.choose("amx", CPUS["zen 4"], ALL)
    with pytest.raises(RuntimeError, match="none of the prebuilt variants"):
        cpu_ops.choose("avx2", CPUS["sandy bridge"], ALL)


def test_a_variant_that_is_not_installed_is_refused_with_how_to_build_it():
    with pytest.raises(RuntimeError, match=r"'avx512' CPU kernels are not installed \(installed: avx2\).*"
                                           r"--variants avx512"):
        cpu_ops.choose("avx512", CPUS["zen 4"], {"avx2"})


def test_named_choices_off_and_native():
    assert cpu_ops.choose("avx2", CPUS["zen 4"], ALL) == "avx2"
    assert cpu_ops.choose("native", CPUS["zen 4"], ALL) == "native"
    assert cpu_ops.choose("off", CPUS["zen 4"], ALL) is None
    with pytest.raises(ValueError, match="unknown CPU kernels 'avx512bf16'"):
        cpu_ops.choose("avx512bf16", CPUS["zen 4"], ALL)


def test_cpu_supports_reads_the_flags_line_of_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Zen 4\nflags\t\t: " + " ".join(sorted(CPUS["zen 4"])) + "\n\n"
                    "processor\t: 1\nflags\t\t: " + " ".join(sorted(CPUS["zen 4"])) + "\n")
    flags = variants.cpu_flags(info)
    assert flags == CPUS["zen 4"]
    assert [v for v in cpu_ops.VARIANTS if variants.cpu_supports(v, flags)] == ["avx512-bf16", "avx512", "avx2"]
    assert variants.cpu_flags(tmp_path / "missing") == frozenset()


def test_off_loads_nothing_and_is_the_process_wide_answer(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_loaded", None)
    assert cpu_ops.load("off") is None
    assert cpu_ops.loaded_variant() is None
    assert cpu_ops.load() is None, "later callers asking for auto get the first answer"
    with pytest.raises(RuntimeError, match="required"):
        cpu_ops.load(require=True)


def test_a_second_variant_in_one_process_is_refused(monkeypatch):
    ops = object()
    monkeypatch.setattr(cpu_ops, "_loaded", cpu_ops._Loaded("auto", "avx512-bf16", ops, Path("x.so")))
    assert cpu_ops.load() is ops and cpu_ops.load("avx512-bf16") is ops
    assert cpu_ops.loaded_variant() == "avx512-bf16"
    with pytest.raises(RuntimeError, match="already loaded the avx512-bf16 CPU kernels.*cannot load 'avx2' too"):
        cpu_ops.load("avx2")
    with pytest.raises(ValueError, match="unknown CPU kernels"):
        cpu_ops.load("sse2")


def test_the_loaded_variant_is_the_best_this_cpu_runs_among_those_installed(ops):
    """In a checkout without a prebuilt library that is the build for this machine ("native")."""
    assert cpu_ops.loaded_variant() == cpu_ops.choose("auto", variants.cpu_flags(), cpu_ops.installed_variants())


def test_installed_variants_are_those_built_for_this_torch_from_these_sources(tmp_path, caplog):
    for v in ("avx2", "avx512-bf16"):
        (tmp_path / variants.by_name(v).library).write_bytes(b"")
    manifest = {"torch": build.torch_version(), "sources": build.sources_hash(),
                "variants": ["avx2", "avx512-bf16", "amx"]}  # amx: no file
    (tmp_path / build.MANIFEST).write_text(json.dumps(manifest))
    assert cpu_ops.installed_variants(tmp_path) == ["avx512-bf16", "avx2"]
    (tmp_path / build.MANIFEST).write_text(json.dumps({**manifest, "torch": "1.0.0"}))
    assert cpu_ops.installed_variants(tmp_path) == []
    assert "for torch 1.0.0" in caplog.text
    (tmp_path / build.MANIFEST).write_text(json.dumps({**manifest, "sources": "edited since"}))
    assert cpu_ops.installed_variants(tmp_path) == []
    assert "built from other sources" in caplog.text
    assert cpu_ops.installed_variants(tmp_path / "nothing") == []


# --- the build ---------------------------------------------------------------------------------


# What each variant's compiler flags must define (and not): the macros the kernels branch on.
MACROS = {
    "avx2": ({"__AVX2__", "__FMA__", "__F16C__", "__LZCNT__"}, {"__AVX512F__"}),
    "avx512": ({"__AVX512F__", "__AVX512BW__", "__AVX512VL__"}, {"__AVX512BF16__", "__AMX_TILE__"}),
    "avx512-bf16": ({"__AVX512F__", "__AVX512VL__", "__AVX512BF16__"}, {"__AMX_TILE__"}),
    "amx": ({"__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__"}, set()),
}


@pytest.mark.parametrize("variant", cpu_ops.VARIANTS)
def test_each_variant_compiles_with_the_macros_its_kernels_branch_on(variant):
    flags = build.cflags(variant)
    assert {"-O3", "-fopenmp", "-std=c++20"} <= set(flags) and "-march=native" not in flags
    out = subprocess.run(["c++", *flags, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True,
                         check=True).stdout
    defined = set(re.findall(r"^#define (\w+)", out, re.M))
    want, unwanted = MACROS[variant]
    assert want <= defined and not unwanted & defined


def test_the_build_for_this_machine_is_native():
    assert "-march=native" in build.cflags(build.NATIVE)
    assert build.library_name(build.NATIVE) == "_cpu_native.so"
    assert build.library_name("avx512-bf16") == "_cpu_avx512_bf16.so"


def test_the_build_names_its_variants():
    assert build.resolve("all") == list(cpu_ops.VARIANTS)
    assert build.resolve("none") == []
    assert build.resolve("avx2, amx") == ["avx2", "amx"]
    with pytest.raises(ValueError, match="unknown CPU kernel variant 'avx3'"):
        build.resolve("avx2,avx3")


def test_one_file_registers_every_op_and_no_test_op_ships():
    """bindings.cpp holds the only TORCH_LIBRARY of torch.ops.pdserve_cpu; stealing_shares_trace
    lives in the tests' own library (tests/kernels/csrc)."""
    csrc = REPO / "kernels" / "csrc"
    registering = sorted(p.name for p in csrc.glob("*.[ch]*") if "TORCH_LIBRARY" in p.read_text())
    assert registering == ["bindings.cpp"]
    assert "stealing_shares_trace" not in "".join(p.read_text() for p in csrc.iterdir())


@pytest.mark.slow  # compiles three translation units (15-50 s)
def test_the_amx_code_compiles(tmp_path):
    """The AMX paths (amx.h's PDSERVE_AMX) compile only into the amx variant, which CI machines
    without AMX neither build for themselves nor run: their translation units compile here (the
    wheel's test builds this CPU's variant whole; `python -m pdserve.kernels.build` all four)."""
    units = [s for s in build.sources() if re.search(r'#include "(amx|attention_avx512)\.h"', s.read_text())]
    assert {"cpu_linear_tiles.cpp", "cpu_prefill_tiles.cpp", "cpu_attention.cpp"} <= {s.name for s in units}

    def compile_one(src: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["c++", *build.cflags("amx"), *build.include_flags(), "-c", str(src),
                               "-o", str(tmp_path / f"{src.stem}.o")], capture_output=True, text=True)

    with ThreadPoolExecutor(2) as pool:
        for src, run in zip(units, pool.map(compile_one, units), strict=True):
            assert run.returncode == 0, f"{src.name}:\n{run.stderr[-3000:]}"


def test_the_command_line_refuses_a_variant_this_cpu_cannot_run(monkeypatch):
    """On a Zen 3 (its flags stood in for this one's: AVX2, no AVX-512), asking for AMX is an error
    that names the variant; nothing is loaded."""
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset(CPUS["zen 3"]))
    monkeypatch.setattr(cpu_ops, "_loaded", None)
    with pytest.raises(SystemExit, match="cannot run the 'amx' CPU kernels"):
        cpu_ops.main(["--variant", "amx"])
    assert cpu_ops.loaded_variant() is None
