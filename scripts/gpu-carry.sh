#!/usr/bin/env bash
# Pack the Python packages a GPU machine lacks, for `make test-gpu` there.
#
# The GPU machines come with their own Python 3.12 + torch + transformers image and no
# package index. The project's other dependencies (dask, pydantic, ase, tblite, pyscf,
# rdkit, mlflow, ...) travel as unpacked wheels, stripped and xz-compressed in two parts,
# each under the 64 MiB a device call may carry:
#
#   scripts/gpu-carry.sh [IMAGE_PACKAGES_FILE]
#     -> .gpuA/site.tar.xz  .gpuB/site.tar.xz  .gpuC/site.tar.xz   (ignored by git)
#        .gpuD/nci2k_v1.tar.xz (the nci2k dataset, ~31 MiB, when bench/data/nci2k_v1 exists)
#
# IMAGE_PACKAGES_FILE lists the image's packages, one per line (default: read from the
# device library's KINDS.md). On the GPU machine, first run carries .gpuA, the next
# (immediately, while the machine is warm) .gpuB; each begins with
#   mkdir -p /tmp/site && tar -xJf .gpuX/site.tar.xz -C /tmp/site
# and the second then runs: PYTHONPATH=/tmp/site make test-gpu GPU_LOG=$OUT/gpu_suite.log
# (docs/gpu-notes.md has the whole recipe and what it found).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
image=${1:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ -z "$image" ]; then
  kinds=../.library/device/KINDS.md
  [ -f "$kinds" ] || { echo "gpu-carry.sh: no image package list (give one; $kinds is missing)" >&2; exit 2; }
  grep -o "Packages: .*" "$kinds" | head -1 | sed 's/Packages: //; s/\.$//' | tr ',' '\n' > "$work/image.raw"
  image=$work/image.raw
fi
norm() { sed 's/^ *//; s/ *$//' | tr 'A-Z_.' 'a-z--' | sort -u; }
norm < "$image" > "$work/image.txt"
# bench-only peers and developer tools stay behind (make test-gpu does not need them)
# (schnetpack and hydra/omegaconf, which `import schnetpack` needs, travel: model.kind schnet|painn)
skip="convergent ruff webdataset braceexpand hydra-colorlog colorlog dirsync"
"$PY" -m pip list --format=freeze 2>/dev/null > "$work/freeze.txt"
sed 's/==.*//' "$work/freeze.txt" | norm > "$work/venv.txt"
mkdir -p "$work/whl" "$work/sdist"
for p in $(comm -23 "$work/venv.txt" "$work/image.txt"); do
  case " $skip " in *" $p "*) continue;; esac
  spec=$(grep -i "^$(echo "$p" | sed 's/-/[-_.]/g')==" "$work/freeze.txt" | head -1)
  if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp -d "$work/whl" --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$spec" 2>/dev/null; then
    # pure-Python sdists (python-hostlist): the module files alone
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$work/sdist" "$spec"
  fi
done
mkdir -p "$work/A" "$work/B"
# two bins by wheel size, largest first (pyscf alone is ~50 MB of zip)
a=0; b=0
for w in $(ls -S "$work"/whl/*.whl); do
  s=$(stat -c %s "$w")
  if [ $a -le $b ]; then d=A; a=$((a + s)); else d=B; b=$((b + s)); fi
  unzip -q -o "$w" -d "$work/$d"
done
for t in "$work"/sdist/*.tar.gz; do
  [ -e "$t" ] || continue
  tar -xzf "$t" -C "$work/sdist"
done
# pure-Python sdists (python-hostlist, antlr4-python3-runtime, which omegaconf needs): their
# top-level modules and their top-level packages (a folder with __init__.py whose parent has
# none), from the sdist's root or src/
for root in "$work"/sdist/*/ "$work"/sdist/*/src/; do
  [ -d "$root" ] || continue
  find "$root" -maxdepth 1 -name '*.py' ! -name setup.py -exec cp {} "$work/B/" \;
  for init in "$root"*/__init__.py; do
    [ -e "$init" ] || continue
    pkg=$(dirname "$init")
    case "$(basename "$pkg")" in test|tests|doc|docs) continue;; esac
    cp -r "$pkg" "$work/B/"
  done
done
find "$work/A" "$work/B" -name '*.so*' -type f -exec strip --strip-unneeded {} + 2>/dev/null || true
find "$work/A" "$work/B" -path '*pyscf*' -type d \( -name test -o -name tests -o -name examples \) \
  -prune -exec rm -rf {} +
# C: the few packages the serving bench and bench/gpu/profile.py need that may sit in B, so
# that the first call (carrying .gpuA and .gpuC) can already run them (at 4e3e605 pydantic
# sat in B and the first call failed on its import)
mkdir -p "$work/C"
for pkg in annotated_types orjson pydantic pydantic_core typing_inspection zstandard; do
  for d in A B; do
    find "$work/$d" -maxdepth 1 -name "${pkg}*" -exec cp -r {} "$work/C/" \;
  done
done
for d in A B C; do
  mkdir -p ".gpu$d"
  tar -C "$work/$d" -cf - . | xz -7 -T0 > ".gpu$d/site.tar.xz"
  size=$(stat -c %s ".gpu$d/site.tar.xz")
  echo ".gpu$d/site.tar.xz: $((size / 1048576)) MiB"
  [ "$size" -lt $((58 * 1048576)) ] || { echo "gpu-carry.sh: .gpu$d/site.tar.xz is over 58 MiB; it will not travel" >&2; exit 2; }
done
# D: the nci2k dataset for the science bench (bench/models/science.py), when it is here
if [ -d bench/data/nci2k_v1 ]; then
  mkdir -p .gpuD
  tar -C bench/data -cf - nci2k_v1 | xz -6 -T0 > .gpuD/nci2k_v1.tar.xz
  echo ".gpuD/nci2k_v1.tar.xz: $(( $(stat -c %s .gpuD/nci2k_v1.tar.xz) / 1048576 )) MiB"
fi
