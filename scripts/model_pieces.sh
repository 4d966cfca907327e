#!/usr/bin/env bash
# The real default model on the lent GPU machine, which reaches no network and takes 64 MiB a
# call: its GGUF (~94 MiB) travels in two pieces over two calls, and the `gguf` package it is
# read with as a wheel. Here (where the model is cached and pip reaches PyPI):
#   scripts/model_pieces.sh
# writes .gpu/model/part-aa, part-ab and SHA256 (the whole file's) and .whl/gguf-*.whl. Then
# two calls, the second within the 30 s the machine stays warm after the first:
#   1. carry [".gpu/model/part-aa", ".gpu/model/SHA256"]:
#        mkdir -p /tmp/model-pieces && cp .gpu/model/part-aa .gpu/model/SHA256 /tmp/model-pieces/
#   2. carry [".gpu/model/part-ab", ".whl", ...]: scripts/gpu_check.sh OUTDIR
# scripts/gpu_check.sh installs the wheels, joins the pieces into $MONOKERNEL_CACHE/models and
# checks the hash before any stage, so the default-model GPU tests and the `spec` stage run.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(python3 -c 'from monokernel.weights.default_model import default_model_path
print(default_model_path())')
mkdir -p .gpu/model
rm -f .gpu/model/part-*
split -b 47M "$model" .gpu/model/part-
sha256sum "$model" | cut -d' ' -f1 >.gpu/model/SHA256
gguf_version=$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d .whl "gguf==$gguf_version"
ls -l .gpu/model .whl
