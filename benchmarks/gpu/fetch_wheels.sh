#!/usr/bin/env bash
# On the development machine: the pinned pure-Python packages (and tokenizers) as Python 3.12 wheels in .whl/,
# which the device machine (torch 2.11 cu130, no datasets/trl/peft/bitsandbytes, no internet) installs with
# benchmarks/gpu/session.sh or plan43.sh. Run from the repository root; .whl/ is git-ignored.
# bitsandbytes' wheel (~60 MiB: a library per CUDA/ROCm version) is slimmed to its CPU and CUDA 13 libraries
# (about 9 MiB) so that the carry stays under the device tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
py=${PYTHON:-.venv/bin/python}
for spec in transformers==5.23.0 tokenizers==0.23.3 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18 trl==1.16.0 \
    peft==0.21.2 bitsandbytes==0.50.2; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "$spec"
done
"$py" - <<'PY'
import glob, os, re, zipfile
keep = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
for path in glob.glob(".whl/bitsandbytes-*.whl"):
    with zipfile.ZipFile(path) as src:
        names = [n for n in src.namelist() if not n.endswith(".so") or keep.search(n)]
        if len(names) == len(src.namelist()):
            continue
        tmp = path + ".slim"
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for n in names:
                data = src.read(n)
                if n.endswith(".dist-info/RECORD"):  # drop the removed libraries' lines
                    data = "".join(x for x in data.decode().splitlines(True)
                                   if not x.split(",")[0].endswith(".so") or keep.search(x.split(",")[0])).encode()
                dst.writestr(src.getinfo(n), data)
    os.replace(tmp, path)
PY
ls -la .whl
du -sh .whl
