#!/usr/bin/env bash
# On the development machine: the pinned pure-Python packages (and tokenizers) as Python 3.12 wheels in .whl/,
# which the device machine (torch 2.11, transformers 5.17, no datasets/trl, no internet) installs with
# benchmarks/gpu/session.sh. Run from the repository root; .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
py=${PYTHON:-.venv/bin/python}
for spec in transformers==5.23.0 tokenizers==0.23.3 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18 trl==1.16.0; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
ls -la .whl
