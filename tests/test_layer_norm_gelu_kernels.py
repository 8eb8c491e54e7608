"""The cuda device's LayerNorm and (ungated) GELU kernels (StarCoder2, Falcon) against the cpu reference, run
through Triton's interpreter without a GPU; and the cuda device's own entry points through the conformance
suite's checks of these ops."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault('TRITON_INTERPRET', '1')
import triton  # noqa: E402,F401  (a test dependency: these tests must not skip silently)

from helpers import here_cuda_ops  # noqa: E402
from lmdeploy.devices import get_device  # noqa: E402
from lmdeploy.devices.conformance import run_self_tests  # noqa: E402
from lmdeploy.devices.cuda.kernels import activation, norm  # noqa: E402

DEV = 'cuda' if HAS_CUDA else 'cpu'
REF = get_device('cpu')
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(int.from_bytes(os.urandom(4), 'little'))


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), 'non-finite output'
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('width', [96, 128])  # a masked block and a full one
def test_layer_norm(dtype, width):
    x = (torch.randn(7, width) * 2 + 3).to(dtype).to(DEV)  # an offset mean: the centring matters
    w = (1 + 0.2 * torch.randn(width)).to(dtype).to(DEV)
    b = (0.5 * torch.randn(width)).to(dtype).to(DEV)
    out = norm.layer_norm(x, w, b, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    ref = REF.layer_norm(x.cpu().float(), w.cpu().float(), b.cpu().float(), 1e-5)
    assert rel_err(out, ref) < tol(dtype) * 2
    assert norm.layer_norm(x[:0], w, b, 1e-5).shape == (0, width)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('approximate', ['none', 'tanh'])
def test_gelu(dtype, approximate):
    x = (torch.randn(5, 1100) * 4).to(dtype).to(DEV)  # two column blocks, the second masked; both tails
    out = activation.gelu(x, approximate)
    assert out.dtype == dtype and out.shape == x.shape
    ref = REF.gelu(x.cpu().float(), approximate)
    assert rel_err(out, ref) < tol(dtype) * 2
    if dtype == torch.float32:  # the two variants differ by more than the tolerance: each is the one asked for
        other = REF.gelu(x.cpu(), 'tanh' if approximate == 'none' else 'none')
        assert (out.cpu() - ref).abs().max() < 1e-5 < 1e-4 < (out.cpu() - other).abs().max()


def test_gelu_refuses_other_approximations():
    with pytest.raises(ValueError, match='approximate'):
        activation.gelu(torch.randn(2, 4, device=DEV), 'sigmoid')


@pytest.mark.parametrize('check', ['gelu[none]', 'gelu[tanh]', 'layer_norm'])
def test_cuda_ops_pass_the_conformance_checks(check):
    [result] = run_self_tests('cuda', ops=here_cuda_ops(), only={check})
    assert result.passed, result.detail
