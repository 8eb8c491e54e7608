"""The cuda device's SmoothQuant W8A8 path (devices/cuda/w8a8.py, kernels/w8a8_quant.py, w8a8_gemm.py) against the
reference (devices/w8a8.py), through Triton's interpreter without a GPU (on a GPU where there is one): the
per-token quantize kernel bit for bit, the scale epilogue against torch, int8's fused GEMM against the two-step
path, the gated gate|up GEMM against the GEMM, activation and quantize, the layers' apply and the conformance
checks."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault('TRITON_INTERPRET', '1')
import triton  # noqa: E402,F401  (a test dependency: these tests must not skip silently)

from helpers import here_cuda_ops  # noqa: E402
import lmdeploy.devices.layers  # noqa: E402,F401  (before devices.w8a8, which it imports)
from lmdeploy.devices.act_quant import steps_apart  # noqa: E402
from lmdeploy.devices.conformance import run_self_tests  # noqa: E402
from lmdeploy.devices.cuda.kernels import w8a8_gemm, w8a8_quant  # noqa: E402
from lmdeploy.devices.reference import ReferenceOps  # noqa: E402
from lmdeploy.devices.w8a8 import W8A8Fp8Linear, W8A8Int8Linear, quantize_per_channel, quantize_per_token  # noqa: E402

DEV = 'cuda' if HAS_CUDA else 'cpu'
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(int.from_bytes(os.urandom(4), 'little'))


def _inputs(m, k, dtype):
    """Rows of different magnitudes, one with a large outlier, one of tiny values (none all zero)."""
    x = torch.randn(m, k) * (torch.rand(m, 1) * 10 + 0.1)
    x[0, k // 3] = 300.0
    x[1] = torch.randn(k) * 1e-3 + 1e-3
    return x.to(dtype).to(DEV)


def _same_bits(got, want):
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    got, want = got.cpu(), want.cpu()
    assert torch.equal(got, want), f'{int((got != want).sum())} values differ'


@pytest.mark.parametrize('fp8', [False, True], ids=['int8', 'fp8'])
@pytest.mark.parametrize('dtype', DTYPES, ids=str)
def test_quantize_matches_the_reference_bit_for_bit(dtype, fp8):
    # (rows, cols, block): one block, a row in several blocks (the loop); both padded to 17 rows (cuda's _int_mm)
    for m, k, block in ((5, 48, 2048), (3, 200, 64)):
        x = _inputs(m, k, dtype)
        q, scale = w8a8_quant.quantize_per_token(x, fp8, min_rows=17, block=block)
        want_q, want_scale = quantize_per_token(x.cpu(), fp8)
        assert q.shape == (max(m, 17), k) and scale.shape == (max(m, 17), 1) and scale.dtype == torch.float32
        _same_bits(scale[:m], want_scale)
        _same_bits(q[:m], want_q)
        assert not q[m:].float().any(), 'padding rows must be zeros'


# the interpreter adds bf16 tensors wrongly (kernels/norm.py's residual add too): bf16 only on a GPU
FUSED_DTYPES = DTYPES if HAS_CUDA else [torch.float32, torch.float16]


def _codes_close(got, want, fp8, max_rows):
    """Codes one step apart at most (an int8 code, an e4m3 spacing at the value), in at most ``max_rows`` rows."""
    assert float(steps_apart(got, want, fp8).max()) <= 1.0
    rows = int((got.cpu().double() != want.cpu().double()).any(dim=1).sum())
    assert rows <= max_rows, f'{rows} rows differ'


@pytest.mark.parametrize('fp8', [False, True], ids=['int8', 'fp8'])
@pytest.mark.parametrize('dtype', FUSED_DTYPES, ids=str)
@pytest.mark.parametrize('with_residual', [False, True], ids=['alone', 'residual'])
def test_norm_with_quantize_equals_norm_then_quantize(dtype, fp8, with_residual):
    """rms_norm_quant writes the codes quantize_per_token makes of rms_norm's output and the same residual sum;
    the padding rows (int8's 17) are zeros. Bit for bit in the interpreter. A GPU may sum a row's squares in
    another order in each kernel (how Triton lays the row over the threads): in a layer-sized input (on a GPU
    only) a row or two then comes out a step apart (kernels/w8a8_quant.py)."""
    from lmdeploy.devices.cuda.kernels import norm
    for m, k in ((5, 48), (3, 200)) + (((1024, 4096), ) if HAS_CUDA else ()):
        x = _inputs(m, k, dtype)
        res = (torch.randn(m, k) * 2).to(dtype).to(DEV) if with_residual else None
        w = (torch.randn(k) * 0.5 + 1).to(dtype).to(DEV)
        q, scale, h = w8a8_quant.rms_norm_quant(x, w, 1e-5, res, fp8, min_rows=17)
        out, h_want = norm.rms_norm(x, w, 1e-5, res)
        want_q, want_scale = w8a8_quant.quantize_per_token(out, fp8, min_rows=17)
        assert (h is None) == (res is None) and (h is None or torch.equal(h, h_want))
        assert not q[m:].float().any(), 'padding rows must be zeros'
        if HAS_CUDA:
            _codes_close(q, want_q, fp8, max_rows=m // 100)
            assert torch.allclose(scale, want_scale, rtol=2**-7, atol=0)
        else:
            _same_bits(q, want_q)
            _same_bits(scale, want_scale)
            ref_q, _ = quantize_per_token(out.cpu(), fp8)  # and the reference's codes of that output
            _same_bits(q[:m], ref_q)


@pytest.mark.parametrize('fp8', [False, True], ids=['int8', 'fp8'])
@pytest.mark.parametrize('dtype', FUSED_DTYPES, ids=str)
def test_gated_activation_with_quantize_equals_activation_then_quantize(dtype, fp8):
    """silu_and_mul_quant: the codes of silu_and_mul's output, one block a row and a row over several blocks."""
    from lmdeploy.devices.cuda.kernels import activation
    for m, n, block in ((4, 40, 2048), (3, 200, 64)):
        x = (torch.randn(m, 2 * n) * 3).to(dtype).to(DEV)
        q, scale = w8a8_quant.silu_and_mul_quant(x, fp8, min_rows=0 if fp8 else 17, block=block)
        out = activation.silu_and_mul(x)
        want_q, want_scale = w8a8_quant.quantize_per_token(out, fp8, min_rows=0 if fp8 else 17)
        _same_bits(q, want_q)
        _same_bits(scale, want_scale)
        assert q.shape == (m if fp8 else 17, n) and not q[m:].float().any()


@pytest.mark.parametrize('fp8', [False, True], ids=['int8', 'fp8'])
def test_quantize_rounds_ties_to_even_and_saturates(fp8):
    """Rows whose scale is exactly 1 (amax = QMAX), holding values halfway between two codes."""
    if fp8:  # e4m3: 1 + 1/16 between 1 and 1.125, 17 between 16 and 18, 2^-10 and 3 * 2^-10 among subnormals
        row = [448.0, 1.0625, 1.1875, 17.0, 19.0, -17.0, 2.0 ** -10, 3 * 2.0 ** -10, -2.0 ** -10, 0.0, -0.0, 1.99]
    else:
        row = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 0.0, 3.49, -3.51]
    x = torch.tensor([row], dtype=torch.float32, device=DEV)
    q, scale = w8a8_quant.quantize_per_token(x, fp8)
    want_q, want_scale = quantize_per_token(x.cpu(), fp8)
    assert float(scale) == 1.0
    _same_bits(q, want_q)


@pytest.mark.parametrize('acc_dtype', [torch.int32, torch.float32], ids=str)
@pytest.mark.parametrize('dtype', DTYPES, ids=str)
def test_scale_epilogue_matches_torch(dtype, acc_dtype):
    m, n, rows = 19, 72, 17  # the last two rows: _int_mm's padding, not written
    if acc_dtype == torch.int32:
        acc = torch.randint(-2**20, 2**20, (m, n), dtype=torch.int32)
    else:
        acc = torch.randn(m, n) * 1e4
    a_scale = torch.rand(m, 1) / 100 + 1e-4
    w_scale = torch.rand(n) / 100 + 1e-4
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        got = w8a8_quant.scale_epilogue(acc.to(DEV), a_scale.to(DEV), w_scale.to(DEV),
                                        None if b is None else b.to(DEV), dtype, rows=rows)
        # the same float32 products in the same order, rounded once, then the bias added in dtype
        prod = acc[:rows].float() * a_scale[:rows] * w_scale
        want = prod.to(dtype)
        if b is not None:
            want = want + b
        size = prod.abs() + (0 if b is None else b.float().abs())
        if dtype == torch.float32 and HAS_CUDA:
            # a GPU fuses the float32 product and the bias add into one fma (one rounding, not torch's two): an
            # H100 gave 1-2 ulps of the product where the bias cancels most of it; 16-bit outputs stay bit for bit
            err = (got.cpu() - want).abs()
            assert bool((err <= 2 * torch.finfo(dtype).eps * size).all()), float(err.max())
        elif dtype == torch.bfloat16 and not HAS_CUDA:
            # the interpreter casts float32 to bf16 by truncation (a GPU rounds to nearest even): each of the (one
            # or two) casts may be one bf16 ulp off
            err = (got.cpu().float() - want.float()).abs()
            assert bool((err <= 2 * torch.finfo(dtype).eps * size).all())
        else:
            _same_bits(got, want)



@pytest.mark.parametrize('tma', [False, True], ids=['pointers', 'tma'])
@pytest.mark.parametrize('dtype', DTYPES, ids=str)
def test_fused_int8_gemm_equals_int_mm_and_the_epilogue(dtype, tma):
    """int8's fused GEMM (more rows) gives what the two-step path gives: the same int32 sums (exact either
    way) and the same epilogue; K not a multiple of the tile's, rows not of the tile's, and a bias. Its tiles
    loaded through pointers, and through TMA descriptors (Hopper's path: K a multiple of 16 there)."""
    if tma and HAS_CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip('TMA descriptors need sm90')
    m, n, k = 70, 72, 208 if tma else 200
    q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_scale = torch.rand(m, 1) / 100 + 1e-4
    w_scale = torch.rand(n) / 100 + 1e-4
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        args = [t.to(DEV) for t in (q, w, a_scale, w_scale)] + [None if b is None else b.to(DEV), dtype]
        got = w8a8_gemm.int8_gemm_scaled(*args, tma=tma)
        acc = (q.long() @ w.long().t()).int().to(DEV)
        want = w8a8_quant.scale_epilogue(acc, *args[2:])
        _same_bits(got, want)


@pytest.mark.parametrize('fp8', [False, True], ids=['int8-codes', 'fp8-codes'])
@pytest.mark.parametrize('dtype', FUSED_DTYPES, ids=str)
def test_gated_gemm_then_codes_equal_gemm_activation_and_quantize(dtype, fp8):
    """gated_gemm_scaled + quantize_with_amax (int8 gate|up on sm80 on): silu(gate) * up of the plain GEMM's
    output, each row's max |value|, and the codes quantize_per_token makes of it (int8, or e4m3 for an fp8
    down projection); tiles over I's and K's ends, a bias, and int8's padding rows."""
    from lmdeploy.devices.cuda.kernels import activation
    m, half, k = 70, 40, 200
    q = torch.randint(-127, 128, (m, k), dtype=torch.int8).to(DEV)
    w = torch.randint(-127, 128, (2 * half, k), dtype=torch.int8).to(DEV)
    a_scale = (torch.rand(m, 1) / 1000 + 1e-5).to(DEV)
    w_scale = (torch.rand(2 * half) / 1000 + 1e-5).to(DEV)
    for b in (None, torch.randn(2 * half).to(dtype).to(DEV)):
        out = w8a8_gemm.int8_gemm_scaled(q, w, a_scale, w_scale, b, dtype)
        # 32 rows and 32 columns (16 gate, 16 up) a tile, and choose()'s
        for tile in ((32, 32, 64, 4, 2), None):
            act, amax = w8a8_gemm.gated_gemm_scaled(q, w, a_scale, w_scale, b, dtype, config=tile)
            want = activation.silu_and_mul(out)
            _same_bits(act, want)
            _same_bits(amax.view(torch.float32), want.float().abs().amax(-1))
        got_q, got_s = w8a8_quant.quantize_with_amax(act, amax, fp8, min_rows=0 if fp8 else 72, block=16)
        want_q, want_s = w8a8_quant.quantize_per_token(want, fp8, min_rows=0 if fp8 else 72)
        _same_bits(got_q, want_q)
        _same_bits(got_s[:m], want_s[:m])
        assert got_q.shape[0] == (m if fp8 else 72) and not got_q[m:].float().any()


def _layer(impl_cls, in_f, out_f, dtype, g):
    """A layer of random float weights quantized as ``lite smooth_quant`` writes them, and a bias."""
    from torch import nn
    layer = nn.Module()
    impl = impl_cls(ReferenceOps()) if impl_cls in (W8A8Int8Linear, W8A8Fp8Linear) else impl_cls(here_cuda_ops())
    impl.create_weights(layer, in_f, out_f, True)
    w, w_scale = quantize_per_channel(torch.randn(out_f, in_f, generator=g), impl.fp8)
    layer.weight.data, layer.weight_scale.data = w.to(DEV), w_scale.to(DEV)
    layer.bias.data = torch.randn(out_f, generator=g).to(dtype).to(DEV)
    impl.process_weights(layer)
    return impl, layer


def _scaled_mm_runs() -> bool:
    try:
        a = torch.ones(16, 16, device=DEV).to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEV)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=str)  # (float32: the conformance checks)
@pytest.mark.parametrize('fmt', ['int8', 'fp8', 'fp8-unit-scaled'])
def test_linear_apply_matches_the_reference(fmt, dtype):
    """The cuda impl's apply (quantize kernel, torch's 8-bit GEMM, epilogue) against the reference's apply on
    the same layer: equal up to the output's last rounding (the reference scales in float64). fp8-unit-scaled:
    the path taken where torch's row-wise scaled GEMM refuses the dtype."""
    from lmdeploy.devices.cuda.w8a8 import CudaW8A8Fp8Linear, CudaW8A8Int8Linear
    fp8 = fmt != 'int8'
    if fp8 and not _scaled_mm_runs():
        pytest.skip(f'torch._scaled_mm does not run on {DEV} in torch {torch.__version__}')
    g = torch.Generator().manual_seed(7)
    ref, ref_layer = _layer(W8A8Fp8Linear if fp8 else W8A8Int8Linear, 64, 48, dtype, g)
    mine, layer = _layer(CudaW8A8Fp8Linear if fp8 else CudaW8A8Int8Linear, 64, 48, dtype, g)
    layer.weight.data, layer.weight_scale.data, layer.bias.data = ref_layer.weight, ref_layer.weight_scale, \
        ref_layer.bias
    assert layer.w8a8_fast
    if fmt == 'fp8-unit-scaled':
        mine.rowwise = False
    # padded to 17 rows for _int_mm / not / int8's fused Triton GEMM (more than FUSED_ROWS rows), with a bias
    for m, with_bias in ((1, True), (20, False), (70, True)):
        x = _inputs(max(m, 2), 64, dtype)[:m].reshape(m, 1, 64)
        got = mine.apply(layer, x, with_bias)
        want = ref.apply(ref_layer, x, with_bias)
        assert got.shape == want.shape == (m, 1, 48) and got.dtype == dtype
        eps = torch.finfo(dtype).eps
        err = (got.double() - want.double()).abs()
        # a rounding of the product and one of the sum with the bias apart (the interpreter's bf16 casts
        # truncate: an ulp each), plus the 8-bit GEMM's accumulation. int8 sums exactly; Hopper's fp8 tensor
        # cores keep only ~14 bits of each partial sum (DeepSeek-V3's report, section 3.3.2; seen here on an
        # H100: 0.5 in a float16 sum of ~10^3 magnitudes), so fp8 may be off by a 2^-9 share of the sum of the
        # terms' magnitudes: still 60x finer than e4m3's own rounding, which any wrong scale or element exceeds
        size = ref.apply(ref_layer, x, False).double().abs()
        if with_bias:
            size = size + ref_layer.bias.double().abs()
        bound = 2 * eps * size + 1e-5 * float(size.max())
        if fp8:
            w_abs = ref_layer.weight.double().abs() * ref_layer.weight_scale.double().view(-1, 1)
            bound = bound + 2.0**-9 * (x.double().abs() @ w_abs.t())
        assert bool((err <= bound).all()), f'max err {float(err.max()):.3g}'


def test_gate_up_with_its_activation_equals_apply_then_silu_and_mul_quant():
    """int8's apply_silu_and_mul_quant (the gated GEMM) against the composed default, apply then
    silu_and_mul_quant, on a gate|up layer with a bias: the same codes and scales, at a decode step's one row,
    at _int_mm's sizes and past FUSED_ROWS."""
    from lmdeploy.devices.cuda.w8a8 import FUSED_ROWS, CudaW8A8Int8Linear
    from lmdeploy.devices.layers import LinearImpl
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    g = torch.Generator().manual_seed(11)
    mine, layer = _layer(CudaW8A8Int8Linear, 64, 96, dtype, g)
    for m in (1, 20, FUSED_ROWS + 6):
        x = _inputs(max(m, 2), 64, dtype)[:m].reshape(m, 1, 64)
        got = mine.apply_silu_and_mul_quant(layer, x, False)
        want = LinearImpl.apply_silu_and_mul_quant(mine, layer, x, False)
        assert (got.rows, got.lead, got.dtype, got.q.shape[1]) == (m, (m, 1), dtype, 48)
        _same_bits(got.q, want.q)
        _same_bits(got.scale, want.scale)


def test_float64_inputs_run_the_reference():
    from lmdeploy.devices.cuda.w8a8 import CudaW8A8Int8Linear
    g = torch.Generator().manual_seed(3)
    ref, ref_layer = _layer(W8A8Int8Linear, 32, 16, torch.float64, g)
    mine, layer = _layer(CudaW8A8Int8Linear, 32, 16, torch.float64, g)
    layer.weight.data, layer.weight_scale.data, layer.bias.data = ref_layer.weight, ref_layer.weight_scale, \
        ref_layer.bias
    x = torch.randn(3, 32, dtype=torch.float64, device=DEV)
    assert torch.equal(mine.apply(layer, x), ref.apply(ref_layer, x))


@pytest.mark.parametrize('check', ['layer:linear[w8a8_int8]', 'layer:linear[w8a8_fp8]'] + [
    f'{op}[{kind}]' for op in ('quantize_per_token', 'rms_norm_quant', 'silu_and_mul_quant') for kind in ('int8', 'fp8')])
def test_cuda_ops_pass_the_w8a8_conformance_checks(check):
    if 'fp8' in check and not _scaled_mm_runs():
        pytest.skip(f'torch._scaled_mm does not run on {DEV} in torch {torch.__version__}')
    dtype = torch.float16 if HAS_CUDA else torch.float32
    ops = here_cuda_ops(dtype)
    if check.startswith('layer:'):
        assert type(ops.layer_impl('linear', check[13:-1])).__module__ == 'lmdeploy.devices.cuda.w8a8'
    [result] = run_self_tests('cuda', ops=ops, only={check})
    assert result.passed, result.detail
