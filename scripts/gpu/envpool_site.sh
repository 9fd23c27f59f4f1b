#!/usr/bin/env bash
# EnvPool for a GPU machine with no package index, small enough to travel with the working tree:
# its wheel (~53 MB) and assets (~62 MB) hold every env family EnvPool has; this unpacks them for
# that machine's Python and keeps only Atari and the gymnasium MuJoCo tasks (~25 MB), in
# .devsite/ (git-ignored). scripts/gpu/figures.sh puts .devsite/ on PYTHONPATH when it is there.
#   scripts/gpu/envpool_site.sh [PYTHON_VERSION]   # default 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
target=${1:-3.12}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for n in 2_28 2_27 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$target" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$tmp" \
  envpool==1.2.5 "envpool-assets>=0.3,<0.4" dm-env optree
rm -rf .devsite && mkdir .devsite
for wheel in "$tmp"/envpool-*.whl "$tmp"/envpool_assets-*.whl "$tmp"/dm_env-*.whl "$tmp"/optree-*.whl; do
  unzip -q -o "$wheel" -d .devsite
done
cd .devsite
# Only the families measured: Atari and MuJoCo's gymnasium tasks. The registry imports every family.
find envpool -name '*.so' ! -name atari_envpool.so ! -name mujoco_gym_envpool.so -delete
rm -rf envpool/vizdoom/bin envpool_assets/vizdoom envpool_assets/gfootball envpool_assets/procgen
find envpool_assets/mujoco -mindepth 1 -maxdepth 1 ! -name assets_gym ! -name '*.py' -exec rm -rf {} +
grep -v -E '^import envpool\.' envpool/entry.py > entry.tmp
grep -E '^import envpool\.(atari|mujoco\.gym)\.' envpool/entry.py >> entry.tmp
mv entry.tmp envpool/entry.py
du -sh .
