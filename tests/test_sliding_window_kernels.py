"""The cuda device's attention kernels with a sliding window and soft-capped scores, against the cpu
reference (Triton's interpreter without a GPU), with tiles small enough that a window skips whole tiles,
masks the tile it starts in and leaves tiles below the diagonal unmasked. Blocks wholly before every
query's window are poisoned with NaN in the kernels' cache: they must not be read at all (the engine may
free them)."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault('TRITON_INTERPRET', '1')
import triton  # noqa: E402,F401

from helpers import here_cuda_ops  # noqa: E402
from paged_cache import reference_filled_cache  # noqa: E402

from lmdeploy.devices import get_device  # noqa: E402
from lmdeploy.devices.cache import KVCache  # noqa: E402
from lmdeploy.devices.conformance import check_names, run_self_tests  # noqa: E402
from lmdeploy.devices.cuda import compiled  # noqa: E402
from lmdeploy.devices.cuda.kernels import attention  # noqa: E402

DEV = 'cuda' if HAS_CUDA else 'cpu'
REF = get_device('cpu')
DTYPE = torch.float16 if HAS_CUDA else torch.float32


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(int.from_bytes(os.urandom(4), 'little'))


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), 'non-finite output'
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def paged(lengths, hkv, d, bs):
    """Shuffled blocks of a float cache (the kernels' copy and the reference's) and the tables. The K/V are
    written at their slots directly (what the fill kernel writes there, which tests/test_cuda_kernels.py
    checks; in the interpreter it is one program a token, which took much of each test here)."""
    nblocks = [-(-n // bs) for n in lengths]
    total = sum(nblocks) + 2
    k = torch.zeros(total, bs, hkv, d, dtype=DTYPE)
    v = torch.zeros_like(k)
    perm = torch.randperm(total).tolist()
    tables = torch.zeros(len(lengths), max(nblocks), dtype=torch.int32)
    for b, n in enumerate(lengths):
        blocks = [perm.pop() for _ in range(nblocks[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[j // bs] * bs + j % bs for j in range(n)])
        k.view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, dtype=DTYPE)
        v.view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, dtype=DTYPE)
    return k, v, tables


def poison_before(k, v, tables, firsts, bs):
    """Copies of the caches with NaN in each sequence's blocks wholly before position ``firsts[b]``."""
    k, v = k.clone(), v.clone()
    for b, first in enumerate(firsts):
        for j in range(first // bs):
            k[int(tables[b, j])] = float('nan')
            v[int(tables[b, j])] = float('nan')
    return k, v


CASES = [  # (window, soft cap)
    (1, None), (5, None), (37, None), (16, 30.0), (None, 8.0), (3, 4.0)]


@pytest.mark.parametrize('window,cap', CASES)
@pytest.mark.parametrize('h,hkv,d,bs,tiles', [(4, 2, 64, 16, (16, 16, 4, 2, False)),
                                              (8, 2, 64, 8, (32, 16, 4, 2, True)),
                                              (2, 2, 128, 16, (16, 32, 4, 2, False))])
def test_prefill(window, cap, h, hkv, d, bs, tiles):
    # fresh prompts, chunks after cached context (crossing the window's edge), a single token
    kv_lens, q_lens = [70, 90, 33, 61], [70, 25, 1, 18]
    k, v, tables = paged(kv_lens, hkv, d, bs)
    q = torch.randn(sum(q_lens), h, d, dtype=DTYPE) * (3 if cap else 1)
    q_start = torch.tensor([0] + q_lens[:-1]).cumsum(0)
    args = (tables, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), d**-0.5, max(q_lens), max(kv_lens))
    ref = REF.paged_prefill_attention(q.float(), KVCache(k.float(), v.float()), *args, sliding_window=window,
                                      logit_softcap=cap)
    firsts = [max(0, n - ql - window + 1) if window else 0 for n, ql in zip(kv_lens, q_lens)]
    kp, vp = poison_before(k, v, tables, firsts, bs)
    out = attention.paged_prefill_attention(q.to(DEV), kp.to(DEV), vp.to(DEV),
                                            *(a.to(DEV) if torch.is_tensor(a) else a for a in args), tiles=tiles,
                                            sliding_window=window, logit_softcap=cap)
    assert rel_err(out, ref) < (1e-5 if DTYPE == torch.float32 else 4e-3)
    if window is not None and window < 20:  # the window matters: full attention differs
        full = REF.paged_prefill_attention(q.float(), KVCache(k.float(), v.float()), *args, logit_softcap=cap)
        assert rel_err(full, ref) > 1e-2


@pytest.mark.parametrize('window,cap', CASES)
@pytest.mark.parametrize('h,hkv,d,bs', [(4, 1, 64, 16), (2, 2, 256, 8)])
def test_decode(window, cap, h, hkv, d, bs):
    kv_lens = [1, 100, 37, 64, 0, 130]
    k, v, tables = paged([max(n, 1) for n in kv_lens], hkv, d, bs)
    q = torch.randn(len(kv_lens), h, d, dtype=DTYPE) * (3 if cap else 1)
    lens = torch.tensor(kv_lens)
    ref = REF.paged_decode_attention(q.float(), KVCache(k.float(), v.float()), tables, lens, d**-0.5, max(kv_lens),
                                     sliding_window=window, logit_softcap=cap)
    kp, vp = poison_before(k, v, tables, [max(0, n - window) if window else 0 for n in kv_lens], bs)
    for num_sms in (1, 132):  # one slice, several slices of the window
        for order in (None, torch.argsort(-lens)):
            out = attention.paged_decode_attention(q.to(DEV), kp.to(DEV), vp.to(DEV), tables.to(DEV), lens.to(DEV),
                                                   d**-0.5, max(kv_lens), num_sms=num_sms, tiles=(16, 1, 4),
                                                   order=None if order is None else order.to(DEV),
                                                   sliding_window=window, logit_softcap=cap)
            assert rel_err(out, ref) < (1e-5 if DTYPE == torch.float32 else 4e-3)
            assert (out[4] == 0).all()  # padding row


@pytest.mark.parametrize('policy', [8, 4])
@pytest.mark.parametrize('window,cap', [(9, None), (9, 6.0), (None, 6.0)])
def test_quantized_cache(policy, window, cap):
    """int8 / int4 caches (int4: rotated and centred K, whose mean the soft cap needs back), head-major."""
    h, hkv, d, bs = 4, 2, 64, 16
    kv_lens = [50, 1, 77, 20]
    ref_cache, cache, tables = reference_filled_cache(kv_lens, hkv, d, bs, DTYPE, policy, DEV, head_major=True)
    if policy == 4:
        mean = torch.randn(hkv, d)
        ref_cache.k_mean = mean
        cache.k_mean = mean.to(DEV)
    lens = torch.tensor(kv_lens)
    q = torch.randn(len(kv_lens), h, d, dtype=DTYPE) * 3
    ref = REF.paged_decode_attention(q.float(), ref_cache, tables, lens, d**-0.5, max(kv_lens),
                                     sliding_window=window, logit_softcap=cap)
    out = attention.paged_decode_attention(q.to(DEV), cache.k, cache.v, tables.to(DEV), lens.to(DEV), d**-0.5,
                                           max(kv_lens), num_sms=132, tiles=(16, 1, 4), k_scale_zero=cache.k_scale_zero,
                                           v_scale_zero=cache.v_scale_zero, sliding_window=window, logit_softcap=cap,
                                           k_mean=cache.k_mean)
    assert rel_err(out, ref) < (1e-4 if DTYPE == torch.float32 else 1e-2)
    q_lens = [20, 1, 30, 20]
    qp = torch.randn(sum(q_lens), h, d, dtype=DTYPE) * 3
    args = (tables, torch.tensor([0] + q_lens[:-1]).cumsum(0), torch.tensor(q_lens), lens, d**-0.5, max(q_lens),
            max(kv_lens))
    ref = REF.paged_prefill_attention(qp.float(), ref_cache, *args, sliding_window=window, logit_softcap=cap)
    out = attention.paged_prefill_attention(qp.to(DEV), cache.k, cache.v, *(a.to(DEV) if torch.is_tensor(a) else a
                                                                            for a in args),
                                            tiles=(16, 16, 4, 2, False), k_scale_zero=cache.k_scale_zero,
                                            v_scale_zero=cache.v_scale_zero, sliding_window=window, logit_softcap=cap,
                                            k_mean=cache.k_mean)
    assert rel_err(out, ref) < (1e-4 if DTYPE == torch.float32 else 1e-2)


def test_compiled_decode_kernel_leaves_windows_and_caps_to_triton():
    """The csrc kernels implement neither: their wrapper declines (None), so the device runs Triton's."""
    q = torch.randn(2, 4, 64)
    cache = KVCache(torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 64))
    args = (q, cache, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 5]), 0.125, 5, 132)
    assert compiled.paged_decode_attention(*args, sliding_window=4) is None
    assert compiled.paged_decode_attention(*args, logit_softcap=50.0) is None


# the 16-bit cache's checks, and int4's soft cap (the device hands its cache's mean key to the kernels, which
# the cap needs back); the quantized caches' other window and cap paths are test_quantized_cache's (the same
# kernels against the reference): their conformance checks cost ~8 s each under the interpreter
WINDOW_CHECKS = [name for name in check_names() if ('window' in name or 'softcap' in name)
                 and ('int' not in name or name.endswith('[softcap,int4]'))]


@pytest.mark.parametrize('check', WINDOW_CHECKS)
def test_the_cuda_device_passes_the_window_and_softcap_conformance_checks(check):
    """The device's own entry points (CudaOps: its cache's int4 mean key handed to the kernels) on the
    conformance suite's window / soft-cap checks (head_dim 64, 128 and 256)."""
    [result] = run_self_tests('cuda', ops=here_cuda_ops(), only={check})
    assert result.passed, result.detail
