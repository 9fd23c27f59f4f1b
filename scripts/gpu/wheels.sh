#!/usr/bin/env bash
# Wheels for a GPU machine that has PyTorch but no package index (an offline node, a lent box):
# what the harness needs beyond the usual CUDA image (torch, numpy, grpcio, opencv, pandas), at the
# versions this checkout's .venv holds, for that machine's Python. Written to .whl/ (git-ignored).
#   scripts/gpu/wheels.sh [PYTHON_VERSION]   # default 3.12
# Then, there: scripts/gpu/figures.sh installs them and measures (it reads .whl/).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
target=${1:-3.12}
mkdir -p .whl
version() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'; }
platforms=()
for n in 2_28 2_27 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
for name in hydra-core omegaconf gymnasium farama-notifications ale-py; do
  spec="$name==$(version "$name")"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$target" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
# antlr4-python3-runtime (Hydra's parser) is published as a source archive only: build its pure wheel here.
"$PY" -m pip wheel --quiet --no-deps -w .whl "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
ls .whl
