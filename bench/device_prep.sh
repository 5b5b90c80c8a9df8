#!/usr/bin/env bash
# Prepares what bench/device_check.sh carries to a lent device host (no package registry there, Python 3.12):
#   .whl/       cp312 manylinux wheels of pyzmq, msgspec, cffi and pycparser
#   .devbuild/  stella._native and stella_ps._kernel built by a Python 3.12 at the portable x86-64-v2 (the AVX2
#               and AVX-512 paths come from the run-time dispatch), in a scratch copy of the sources, so that the
#               checkout's own modules (same abi3 file names) stay as they are
# Both folders are ignored through .git/info/exclude. Needs a Python 3.12 here: PY312, python3.12 on the PATH,
# or pyenv's. cffi is pinned to the checkout's own version on both sides (a module needs its backend's).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ -z "${PY312:-}" ]; then  # the first that runs (pyenv's shim is on the PATH even where 3.12 is not its global)
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$c; break; fi
  done
fi
[ -n "${PY312:-}" ] || { echo "device_prep: needs a Python 3.12 (set PY312)" >&2; exit 1; }
for d in /.whl/ /.devbuild/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
CFFI=$("$PY" -c 'import cffi; print(cffi.__version__)')
rm -rf .whl .devbuild
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl pyzmq msgspec "cffi==$CFFI" pycparser
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY312" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" -q install "cffi==$CFFI" pycparser setuptools
mkdir "$tmp/src"
git ls-files -z native client server setup.py pyproject.toml README.md | xargs -0 cp --parents -t "$tmp/src"
(cd "$tmp/src" && STELLA_NATIVE_ARCH=x86-64-v2 "$tmp/venv/bin/python" setup.py -q build_ext --inplace > build.log 2>&1) \
  || { tail -20 "$tmp/src/build.log" >&2; exit 1; }
mkdir -p .devbuild
cp "$tmp/src/client/stella/_native.abi3.so" "$tmp/src/server/stella_ps/_kernel.abi3.so" .devbuild/
ls -l .whl .devbuild
