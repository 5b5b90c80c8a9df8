"""Stella as a library: ``python -m build`` makes an sdist that holds what building the C
needs and, from it, a wheel that carries both compiled modules; the wheel installs into a
clean venv where no compiler can be found, and its ``stella demo`` trains through its own
``stella-ps``.

The clean venv gets the dependencies (numpy, torch, pyzmq...) from this venv through a
``.pth`` line, not from an index: a directory a ``.pth`` adds is not a site directory, so
the ``.pth`` files in it, among them the editable install's hook onto this checkout, are
not run, and ``stella`` can only come from the wheel (asserted, not assumed).
"""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from stella import native_isa

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # the build compiles the C: ~40 s of CPU, ~25 s on two idle cores

NO_COMPILER = "/nonexistent/cc"


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(sdist, wheel)`` as ``python -m build`` makes them from this checkout: the sdist,
    then the wheel from the unpacked sdist. No isolation: the build requirements are this
    venv's, nothing is downloaded."""
    out = tmp_path_factory.mktemp("dist")
    # the two modules compile side by side (build_ext's --parallel, through distutils' extra config file)
    (out / "parallel.cfg").write_text("[build_ext]\nparallel = 2\n")
    env = {k: v for k, v in os.environ.items() if k not in ("STELLA_NATIVE_ARCH", "STELLA_NATIVE_DEBUG")}
    env.update(DIST_EXTRA_CONFIG=str(out / "parallel.cfg"), TMPDIR=str(out))  # build unpacks the sdist in TMPDIR
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # a wheel is built for a portable level, whatever the machine (setup.py); the dispatch adds v3/v4
    log = proc.stdout + proc.stderr
    if os.uname().machine == "x86_64":
        assert "-march=x86-64-v2" in log and "-march=native" not in log, log[-4000:]
    (sdist,) = out.glob("stella-*.tar.gz")
    (wheel,) = out.glob("stella-*.whl")
    return sdist, wheel


def test_sdist_holds_what_the_build_needs(dists: tuple[Path, Path]) -> None:
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    native = {f"native/{p.relative_to(ROOT / 'native')}" for p in (ROOT / "native").rglob("*")
              if p.suffix in (".c", ".h", ".py") and p.relative_to(ROOT / "native").parts[0] != "bench"}
    assert "native/build_cffi.py" in native and "native/isa/compress_v4.c" in native and "native/cdefs/core.h" in native
    assert native <= names, sorted(native - names)
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "client/stella/py.typed",
            "server/stella_ps/py.typed", "client/stella/__init__.py", "server/stella_ps/daemon.py"} <= names
    # benchmark-only C, the tests, the benchmarks, built files: none of them
    assert not [n for n in names if n.startswith(("native/bench/", "tests/", "bench/", "docker/", "docs/", "build/"))
                or n.endswith((".so", ".o", ".pyc")) or n in ("client/stella/_native.c", "server/stella_ps/_kernel.c")]


def test_wheel_holds_the_compiled_modules_and_nothing_else(dists: tuple[Path, Path]) -> None:
    _, wheel = dists
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"stella", "stella_ps", next(t for t in top if t.endswith(".dist-info"))}, top
    assert [n for n in names if n.startswith("stella/_native") and n.endswith(".so")], names
    assert [n for n in names if n.startswith("stella_ps/_kernel") and n.endswith(".so")], names
    assert {"stella/py.typed", "stella_ps/py.typed", "stella/planning/__init__.py"} <= set(names)
    assert not [n for n in names if n.endswith(".c") or "/tests/" in n or "/bench/" in n]
    for extra in ("worker", "hf", "lightning"):
        assert f"Provides-Extra: {extra}" in meta
    assert "Requires-Dist: transformers" in meta and "Requires-Dist: lightning" in meta


@pytest.mark.timeout(600)
def test_wheel_installs_without_a_compiler_and_trains(dists: tuple[Path, Path], tmp_path: Path) -> None:
    _, wheel = dists
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py, bindir = venv / "bin" / "python", venv / "bin"
    # this venv's pip installs into the clean one (which has none), before the .pth exists: with it,
    # pip would see this venv's editable stella as installed already
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                    "--no-cache-dir", "--disable-pip-version-check", "-q", str(wheel)], check=True, timeout=300)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    (Path(purelib) / "_stella_test_deps.pth").write_text("".join(f"{d}\n" for d in site.getsitepackages()))

    # no compiler on PATH or in CC/CXX, no checkout on sys.path, no user site, temporary files under tmp_path
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "PYTHONNOUSERSITE": "1",
           "CC": NO_COMPILER, "CXX": NO_COMPILER, "LANG": "C.UTF-8"}
    sources = [str(ROOT), str(ROOT / "client"), str(ROOT / "server")]  # where an editable stella is found
    probe = f"""
import json, shutil, sys
import stella, stella_ps, stella._native, stella_ps._kernel
from stella_ps import kernel
print(json.dumps({{
    "compilers": [c for c in ("cc", "gcc", "clang", "c++", "g++") if shutil.which(c)],
    "editable": sorted(m for m in sys.modules if m.startswith("__editable__")),
    "files": [m.__file__ for m in (stella, stella_ps, stella._native, stella_ps._kernel)],
    "isa": [stella.native_isa().compiled, kernel.native_isa().compiled],
    "checkout_on_path": [p for p in sys.path if p in {sources!r}],
}}))
"""
    res = subprocess.run([py, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    facts = json.loads(res.stdout)
    assert facts["compilers"] == [] and facts["editable"] == [] and facts["checkout_on_path"] == [], facts
    for f in facts["files"]:
        assert Path(f).is_relative_to(purelib), facts
    assert facts["files"][2].endswith(".so") and facts["files"][3].endswith(".so")
    # dispatched as the editable build here is: the portable copy and, with GCC 11+ on x86-64, v3 and v4
    assert facts["isa"] == [list(native_isa().compiled)] * 2, facts

    # the entry points the wheel installed: a real stella-ps, two workers, a few steps of digits
    subprocess.run([bindir / "stella-ps", "--help"], env=env, cwd=tmp_path, check=True, capture_output=True,
                   timeout=120)
    steps = 50
    demo = subprocess.run([bindir / "stella", "demo", "--steps", str(steps), "--progress-every", "0",
                           "--json", str(tmp_path / "demo.json")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    result = json.loads((tmp_path / "demo.json").read_text())
    # the server's model advanced by the rounds of both workers, and learned (chance is 0.1)
    assert steps // 4 < result["server_version"] <= steps + 1, result
    assert result["test_accuracy"] > 0.5, result
