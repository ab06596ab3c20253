#!/usr/bin/env bash
# Downloads into .whl/ the wheels tools/gpu_check.sh installs on a GPU machine that has no network: the packages
# tokenmill's offline path needs that the lent machines' image lacks (msgspec, platformdirs), and the transformers
# of this checkout's .venv, which the golden tests compare with (the image's older one computes Gemma 2
# differently), slimmed to the model packages the GPU check imports; Python 3.12, x86-64. Run from the repository
# root on a machine with PyPI (.whl/ is git-ignored).
set -eu
PY=${PYTHON:-python3}
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "msgspec>=0.18" "platformdirs>=4" \
    "transformers==${TRANSFORMERS_VERSION:-$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')}"
# the lent machine takes the tree and .whl/ under one size limit: keep only the model packages the check imports
"$PY" tools/slim_transformers_wheel.py .whl/transformers-*.whl
