"""The cuda device's W4A16 path (kernels/w4a16.py through devices/cuda/w4a16.py) against the reference AWQ and
GPTQ layers (devices/quant_formats.py) on random checkpoints: Triton's interpreter without a GPU, so tiny
shapes (the block-size table and its speed are benchmark/w4a16_gemm.py's, on a GPU)."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault('TRITON_INTERPRET', '1')
import triton  # noqa: E402,F401

from torch import nn  # noqa: E402
from helpers import here_cuda_ops  # noqa: E402

from lmdeploy.devices.conformance import run_self_tests  # noqa: E402
from lmdeploy.devices.cuda.kernels import w4a16  # noqa: E402
from lmdeploy.devices.cuda.w4a16 import CudaAwqLinear, CudaGptqLinear  # noqa: E402
from lmdeploy.devices.quant_formats import AwqLinear, GptqLinear, unpack_int4  # noqa: E402
from lmdeploy.devices.reference import ReferenceOps  # noqa: E402

DEV = 'cuda' if HAS_CUDA else 'cpu'
DTYPE = torch.float16 if HAS_CUDA else torch.float32
ROWS = (1, 3, 17, 40, 130)  # the decode (split-K) configuration, the GEMM tile, dequantize + GEMM


OPS = here_cuda_ops()


def g_idx_for(kind, n_in, group, gen):
    """GPTQ's g_idx: in order, a permutation of in-order groups (a real desc_act checkpoint: equal groups once
    sorted) or any group per column (unequal groups)."""
    groups = 1 if group == -1 else n_in // group
    in_order = torch.arange(n_in) * groups // n_in
    if kind == 'perm':
        return in_order[torch.randperm(n_in, generator=gen)].int()
    while kind == 'random':  # (groups of equal sizes would be read as in-order groups once sorted)
        g = torch.randint(0, groups, (n_in, ), generator=gen, dtype=torch.int32)
        if groups == 1 or len(set(torch.bincount(g, minlength=groups).tolist())) > 1:
            return g
    return in_order.int()


def layers(fmt, config, n_in, n_out, bias, dtype, gen, g_kind=None):
    """(cuda impl, its layer, reference impl, its layer): the same random checkpoint, both processed."""
    ref_cls = AwqLinear if fmt == 'awq' else GptqLinear
    impl, ref_impl = OPS.layer_impl('linear', fmt, config), ref_cls(ReferenceOps(), config)
    assert type(impl) is (CudaAwqLinear if fmt == 'awq' else CudaGptqLinear)
    mine, ref = nn.Module(), nn.Module()
    impl.create_weights(mine, n_in, n_out, bias)
    ref_impl.create_weights(ref, n_in, n_out, bias)
    for name, p in ref.named_parameters():
        if name == 'g_idx':
            value = g_idx_for(g_kind, n_in, config['group_size'], gen)
        elif p.dtype == torch.int32:
            value = torch.randint(-2**31, 2**31, p.shape, generator=gen, dtype=torch.int32)
        elif name == 'scales':
            value = torch.rand(p.shape, generator=gen) / 40 + 1e-3
        else:
            value = torch.randn(p.shape, generator=gen)
        value = value if p.dtype == torch.int32 else value.to(dtype)
        getattr(ref, name).data = value.clone()
        getattr(mine, name).data = value.clone().to(DEV)
    impl.process_weights(mine)
    ref_impl.process_weights(ref)
    return impl, mine, ref_impl, ref


def assert_close(got, want, dtype):
    """Equal up to the order of the float32 sums (and, in 16 bits, the output's rounding)."""
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f'max abs err {err:.3g} of outputs up to {scale:.3g}'


CASES = [  # (format, group, desc_act: None, 'perm' or 'random', in, out, bias)
    ('awq', 32, None, 96, 64, True),
    ('awq', 64, None, 128, 40, False),
    ('gptq', 32, None, 64, 96, False),
    ('gptq', 64, None, 128, 32, True),
    ('gptq', -1, None, 96, 48, False),
    ('gptq', 32, 'perm', 128, 40, True),
    ('gptq', 64, 'random', 128, 64, False),
    ('gptq', -1, 'random', 64, 32, False),
]


def config_of(fmt, group, desc):
    if fmt == 'awq':
        return {'quant_method': 'awq', 'bits': 4, 'group_size': group, 'zero_point': True, 'version': 'gemm'}
    return {'quant_method': 'gptq', 'bits': 4, 'group_size': group, 'desc_act': desc is not None, 'sym': False}


@pytest.mark.parametrize('fmt,group,desc,n_in,n_out,bias', CASES)
def test_cuda_apply_equals_the_reference(fmt, group, desc, n_in, n_out, bias):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    impl, mine, ref_impl, ref = layers(fmt, config_of(fmt, group, desc), n_in, n_out, bias, DTYPE, gen, desc)
    assert not hasattr(mine, 'weight_q') and mine.w4_qweight.shape == (n_in // 8, n_out)  # repacked, freed
    assert (mine.w4_perm is not None) == (desc is not None and group != -1)  # (one group: g_idx all 0, in order)
    assert (mine.w4_gidx is not None) == (desc == 'random' and group != -1)
    assert (mine.bias is not None) == bias
    for m in ROWS:
        x = torch.randn(m, n_in, generator=gen).to(DTYPE)
        assert_close(impl.apply(mine, x.to(DEV)), ref_impl.apply(ref, x), DTYPE)
    x = torch.randn(2, 3, n_in, generator=gen).to(DTYPE)  # leading dims, no bias
    assert_close(impl.apply(mine, x.to(DEV), with_bias=False), ref_impl.apply(ref, x, with_bias=False), DTYPE)


@pytest.mark.parametrize('fmt,desc', [('awq', None), ('gptq', 'random')])
def test_half_precision(fmt, desc):
    """float16 activations, scales and zeros (bf16 is not checked here: Triton's interpreter truncates where
    it should round and its bf16 tl.dot is wrong)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    impl, mine, ref_impl, ref = layers(fmt, config_of(fmt, 32, desc), 128, 64, True, torch.float16, gen, desc)
    for m in ROWS:
        x = torch.randn(m, 128, generator=gen).half()
        assert_close(impl.apply(mine, x.to(DEV)), ref_impl.apply(ref, x), torch.float16)


def random_codes(k, n, group, gen):
    """A random [n, k] layer's codes, zero points and scales: (q, z, s, bias, W float32 = (q - z) s, the
    kernels' float32 arguments on DEV: packed codes, scales and zeros [groups, n])."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    z = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    s = torch.rand(n, k // group, generator=gen) / 40 + 1e-3
    bias = torch.randn(n, generator=gen)
    w = (q.float() - z.float().repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)
    args = [t.to(DEV) for t in (w4a16.pack_int4(q), s.t().contiguous(), z.t().float().contiguous())]
    return q, z, s, bias, w, args


def in_dtype(q, z, s, group, args, dt):
    """(the arguments with scales and zeros in ``dt``, W with its scales rounded to ``dt``, as float32)."""
    w = (q.float() - z.float().repeat_interleave(group, 1)) * s.to(dt).float().repeat_interleave(group, 1)
    return [args[0]] + [a.to(dt) for a in args[1:]], w


@pytest.mark.parametrize('reshape', [True, False])
def test_split_k_and_unpacking_variants(reshape):
    """Forced split-K (the partial sums and the bias added by the second kernel, a last split shorter than
    the others), both ways of unpacking the int32s, scales gathered per row and read per tile."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    k, n, m, group = 160, 48, 3, 32
    q, z, s, bias, w, args = random_codes(k, n, group, gen)
    x = torch.randn(m, k, generator=gen)
    want = x.double() @ w.double().t() + bias.double()
    for cfg in (w4a16.Config(16, 32, 32, 3, 4, 1), w4a16.Config(16, 16, 16, 4, 4, 1)):
        got = w4a16.w4a16_linear(x.to(DEV), *args, group, None, bias.to(DEV), config=cfg, reshape=reshape)
        assert_close(got, want, torch.float32)
    g_idx = (torch.arange(k, dtype=torch.int32) // group).to(DEV)  # the same groups, looked up per column
    got = w4a16.w4a16_linear(x.to(DEV), *args, 1, g_idx, bias.to(DEV), config=w4a16.Config(16, 32, 64, 2, 4, 1),
                             reshape=reshape)
    assert_close(got, want, torch.float32)



def test_swapped_operands():
    """The swapped tile (out^T = W x^T) against the float product: a split K with the bias added after it,
    groups per tile and per row, g_idx, rows and columns that do not fill a tile; and in float16 with the
    nibbles made floats by the mantissa trick, the same outputs as converting them."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    for k, n, m, group, cfg, by_gidx in ((160, 48, 3, 32, w4a16.Config(16, 32, 32, 3, 4, 1, True), False),
                                         (256, 80, 37, 64, w4a16.Config(32, 64, 64, 1, 4, 1, True), False),
                                         (192, 40, 19, 32, w4a16.Config(16, 16, 64, 2, 4, 1, True), True)):
        q, z, s, bias, w, args = random_codes(k, n, group, gen)
        x = torch.randn(m, k, generator=gen)
        g_idx = (torch.arange(k, dtype=torch.int32) // group).to(DEV) if by_gidx else None
        got = w4a16.w4a16_linear(x.to(DEV), *args, 1 if by_gidx else group, g_idx, bias.to(DEV), config=cfg)
        assert_close(got, x.double() @ w.double().t() + bias.double(), torch.float32)
        half, w16 = in_dtype(q, z, s, group, args, torch.float16)
        got = w4a16.w4a16_linear(x.half().to(DEV), *half, group, None, None, config=cfg, dt_math=True, magic=True)
        want = w4a16.w4a16_linear(x.half().to(DEV), *half, group, None, None, config=cfg, dt_math=True)
        assert torch.equal(got, want)
        assert_close(got.cpu(), x.half().double() @ w16.half().double().t(), torch.float16)


def test_groups_that_split_a_packed_int32_take_the_fused_tile_at_any_rows():
    """A group of 4 inputs (half an int32's 8) has no dequantize + cuBLAS path: from DEQUANT_ROWS rows on the
    fused tile still runs, the table's widest, against the float product."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    k, n, m, group = 64, 40, w4a16.DEQUANT_ROWS + 2, 4
    assert w4a16.choose(m, n, k, group, 132) is None
    q, z, s, bias, w, args = random_codes(k, n, group, gen)
    x = torch.randn(m, k, generator=gen)
    got = w4a16.w4a16_linear(x.to(DEV), *args, group, None, bias.to(DEV))
    assert_close(got, x.double() @ w.double().t() + bias.double(), torch.float32)


def test_magic_dequantization_gives_the_same_values():
    """``magic``: each nibble or-ed into the mantissa of 2^10 (float16; bfloat16's 2^7 on a GPU, where the
    interpreter's bfloat16 is not exact) gives the very outputs of the converting path, with groups per tile
    and per row, and a split K."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    dtypes = (torch.float16, torch.bfloat16) if HAS_CUDA else (torch.float16, )
    for k, n, m, group, cfg in ((256, 48, 5, 64, w4a16.Config(16, 32, 64, 1, 4, 1)),
                                (192, 40, 19, 32, w4a16.Config(32, 16, 64, 2, 4, 1))):
        q, z, s, _, _, args32 = random_codes(k, n, group, gen)
        for dt in dtypes:
            x = torch.randn(m, k, generator=gen).to(dt)
            args, w = in_dtype(q, z, s, group, args32, dt)
            got = w4a16.w4a16_linear(x.to(DEV), *args, group, None, None, config=cfg, dt_math=True, magic=True)
            want = w4a16.w4a16_linear(x.to(DEV), *args, group, None, None, config=cfg, dt_math=True)
            assert torch.equal(got, want)
            assert_close(got.cpu(), x.double() @ w.to(dt).double().t(), dt)


def test_gemv_kernel(monkeypatch):
    """The GEMV kernel (up to GEMV_ROWS rows): scales per tile (the tile in one group) and per packed row
    (smaller groups), K split with the last program adding the splits up (a last split shorter than the
    others, the bias), every counter back at zero after each call (the second call as right as the first),
    and the default route of 1 to GEMV_ROWS rows through it."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    calls = []
    real = w4a16._gemv
    monkeypatch.setattr(w4a16, '_gemv', lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for k, n, group, cfg in ((384, 80, 128, w4a16.GemvConfig(16, 32, 3, 4, 1)),
                             (320, 48, 32, w4a16.GemvConfig(16, 32, 2, 4, 1)),
                             (256, 40, 64, w4a16.GemvConfig(8, 64, 1, 4, 1)), (256, 72, 256, None)):
        _, _, _, bias, w, args = random_codes(k, n, group, gen)
        for m in range(1, 5):  # (forced: the kernel's 4 rows; by default up to GEMV_ROWS)
            x = torch.randn(m, k, generator=gen)
            for b in (bias, None):
                want = x.double() @ w.double().t() + (0 if b is None else b.double())
                for _ in range(2):
                    got = w4a16.w4a16_linear(x.to(DEV), *args, group, None, None if b is None else b.to(DEV),
                                             gemv=cfg)
                    assert_close(got, want, torch.float32)
                    assert not w4a16.reserve_locks(args[0].device).any()
    assert calls == [m for cfg in (1, 1, 1, None) for m in range(1, 5) for _ in range(4)
                     if cfg or m <= w4a16.GEMV_ROWS]
    with pytest.raises(ValueError, match='in-order groups'):
        w4a16.w4a16_linear(x.to(DEV), *args, 1, torch.zeros(k, dtype=torch.int32, device=DEV),
                           gemv=w4a16.GemvConfig(16, 32, 1, 4, 1))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16], ids=str)
def test_dequantize_is_the_rounded_weight(dtype):
    """The scratch weight of many rows' path: (q - z) * s rounded once to the dtype, bit for bit, whether
    groups are read per packed row or looked up per input (g_idx); packed rows and columns past a tile."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    k, n, group = 8 * 19, 136, 8
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    z = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=gen) / 40 + 1e-3).to(dtype)
    want = ((q.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)).to(dtype)
    args = [t.to(DEV) for t in (w4a16.pack_int4(q), s.t().contiguous(), z.t().to(dtype).contiguous())]
    got = w4a16.dequantize(*args, group)
    assert got.dtype == dtype and torch.equal(got.cpu(), want.t())
    g_idx = (torch.arange(k, dtype=torch.int32) // group).to(DEV)
    assert torch.equal(w4a16.dequantize(*args, 1, g_idx).cpu(), want.t())


def test_dequantizing_in_the_activation_dtype_gives_the_same_values():
    """dt_math (the weight dequantized in float16 arithmetic) against float32 arithmetic rounded once: the same
    outputs bit for bit, since q - z is a small integer and the product rounds once either way."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), 'little'))
    k, n, group = 256, 64, 64
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    z = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=gen) / 40 + 1e-3).half()
    args = [t.to(DEV) for t in (w4a16.pack_int4(q), s.t().contiguous(), z.t().half().contiguous())]
    for m in (1, 40):
        x = torch.randn(m, k, generator=gen).half().to(DEV)
        plain = w4a16.w4a16_linear(x, *args, group, dt_math=False)
        assert torch.equal(w4a16.w4a16_linear(x, *args, group, dt_math=True), plain)
        assert torch.equal(w4a16.w4a16_linear(x, *args, group), plain)  # the default (dt_math up to 32 rows)

def test_pack_int4_is_gptq_packing():
    q = torch.randint(0, 16, (24, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(w4a16.pack_int4(q), 0).t(), q)


def test_the_table():
    """Decode rows split K over the SMs in the swapped tile; a GEMM's rows do not split; a tile never straddles a
    group; from DEQUANT_ROWS rows (from 256 on the widest layers) dequantize + cuBLAS (None)."""
    assert w4a16.choose(1, 4096, 4096, 128, 132) == w4a16.Config(16, 64, 128, 8, 4, 4, True)
    assert w4a16.choose(1, 28672, 4096, 128, 132).split == 2
    assert w4a16.choose(16, 4096, 4096, 128, 132).split == 4
    assert w4a16.choose(64, 4096, 4096, 128, 132) == w4a16.Config(32, 64, 128, 1, 4, 4, True)
    assert w4a16.choose(64, 28672, 4096, 128, 132) == w4a16.Config(64, 128, 128, 1, 4, 3)
    assert w4a16.choose(96, 4096, 4096, 128, 132) == w4a16.Config(128, 128, 64, 1, 8, 3)
    assert w4a16.choose(128, 4096, 4096, 128, 132) is None
    assert w4a16.choose(200, 28672, 4096, 128, 132) == w4a16.Config(128, 128, 64, 1, 8, 3)
    assert w4a16.choose(256, 28672, 4096, 128, 132) is None
    assert w4a16.choose(4096, 4096, 4096, 128, 132) is None
    assert w4a16.choose(1, 4096, 4096, 32, 132).block_k == 32
    assert w4a16.SMALL_M < 64 < w4a16.DEQUANT_ROWS  # (the fused tile in between)
    assert w4a16.GEMV_ROWS < w4a16.SMALL_M
    # the GEMV: ~4 programs per SM, at least two tiles of K each
    assert w4a16.gemv_choose(1, 6144, 4096, 128, 132) == w4a16.GemvConfig(8, 512, 32, 4, 1)
    assert w4a16.gemv_choose(1, 28672, 4096, 128, 132).split == 19
    assert w4a16.gemv_choose(2, 28672, 4096, 128, 132).split == 10
    assert w4a16.gemv_choose(1, 4096, 256, 128, 132).split == 2
    # Llama-3-70B's o_proj and down_proj: ~4 programs per SM, not 8
    assert w4a16.gemv_choose(1, 8192, 8192, 128, 132).split == 33
    assert w4a16.gemv_choose(1, 8192, 28672, 128, 132).split == 33


@pytest.mark.parametrize('fmt', ['awq', 'gptq'])
def test_the_cuda_device_passes_the_layer_conformance_check(fmt):
    """The conformance suite's check of the device's linear (every example config, silu_and_mul included)."""
    [result] = run_self_tests('cuda', ops=OPS, only={f'layer:linear[{fmt}]'})
    assert result.passed, result.detail
