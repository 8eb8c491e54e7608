"""The package build: pure Python, plus the compiled CUDA kernels (csrc/cuda, the module
lmdeploy.devices.cuda._C) where they can be built and used.

LMDEPLOY_BUILD_CUDA: auto (default: build when nvcc is there and so is a CUDA build of torch, or, in an
isolated build that cannot see torch, a GPU driver), 1 (build whenever nvcc is there), 0 (never).
LMDEPLOY_CUDA_ARCHS picks the architectures (csrc/build.py). Without a build, one line says why and
the cuda device runs on its Triton kernels alone.
"""
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _builder():
    sys.path.insert(0, os.path.join(HERE, 'csrc'))
    import build
    return build


def _why_not() -> str:
    """'' when the kernels should be built here, else the reason they are not."""
    flag = os.environ.get('LMDEPLOY_BUILD_CUDA', 'auto').strip().lower()
    if flag in ('0', 'no', 'false', 'off'):
        return 'LMDEPLOY_BUILD_CUDA=0'
    if _builder().find_nvcc() is None:
        return 'no nvcc'
    if flag in ('1', 'yes', 'true', 'on'):
        return ''
    try:
        import torch
        return '' if torch.version.cuda else 'torch is a CPU build'
    except ImportError:
        return '' if shutil.which('nvidia-smi') else 'no GPU driver (set LMDEPLOY_BUILD_CUDA=1 to build anyway)'


class BuildCudaKernels(build_ext):

    def build_extension(self, ext):
        why = _why_not()
        if why:
            print(f'lmdeploy: not building the compiled CUDA kernels ({why}); the cuda device uses its Triton '
                  'kernels', flush=True)
            return
        builder = _builder()
        path = builder.build(out_dir=os.path.dirname(self.get_ext_fullpath(ext.name)))
        if getattr(self, 'editable_mode', False) or self.inplace:  # pip install -e .: next to the sources
            shutil.copy2(path, os.path.join(builder.PACKAGE_DIR, os.path.basename(path)))

    def copy_extensions_to_source(self):
        pass  # build_extension puts it there (a skipped build has nothing to copy)

    def get_outputs(self):
        return [p for p in super().get_outputs() if os.path.exists(p)]


setup(ext_modules=[Extension('lmdeploy.devices.cuda._C', sources=[])], cmdclass={'build_ext': BuildCudaKernels})
