"""The cuda device's attention kernels with ALiBi position biases (Baichuan-13B, Falcon-RW), against the cpu
reference (Triton's interpreter without a GPU): prompts, chunks after cached context and single tokens with heads
packed per KV head, the int4 cache, and the device's entry points on the conformance suite's ALiBi checks
(unpacked prefill tiles; decode cut into several slices, a padding row)."""
import math

import pytest
import torch

from paged_cache import reference_filled_cache
from test_sliding_window_kernels import DEV, DTYPE, HAS_CUDA, REF, here_cuda_ops, paged, rel_err, seeded  # noqa: F401

from lmdeploy.devices.cache import KVCache
from lmdeploy.devices.conformance import check_names, run_self_tests
from lmdeploy.devices.cuda.kernels import attention

TOL = 1e-5 if DTYPE == torch.float32 else 4e-3


def slopes(h: int) -> torch.Tensor:
    """ALiBi's geometric slopes for ``h`` heads (a power of two), as Baichuan-13B and BLOOM make them."""
    return torch.tensor([2.0**(-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)


@pytest.mark.parametrize('h,hkv,d,bs,tiles', [(8, 2, 64, 8, (32, 16, 4, 2, True))])  # (unpacked: the conformance)
def test_prefill(h, hkv, d, bs, tiles):
    kv_lens, q_lens = [70, 90, 33, 61], [70, 25, 1, 18]
    k, v, tables = paged(kv_lens, hkv, d, bs)
    q = torch.randn(sum(q_lens), h, d, dtype=DTYPE)
    q_start = torch.tensor([0] + q_lens[:-1]).cumsum(0)
    args = (tables, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), d**-0.5, max(q_lens), max(kv_lens))
    ref = REF.paged_prefill_attention(q.float(), KVCache(k.float(), v.float()), *args, alibi_slopes=slopes(h))
    out = attention.paged_prefill_attention(q.to(DEV), k.to(DEV), v.to(DEV),
                                            *(a.to(DEV) if torch.is_tensor(a) else a for a in args), tiles=tiles,
                                            alibi_slopes=slopes(h).to(DEV))
    assert rel_err(out, ref) < TOL
    plain = REF.paged_prefill_attention(q.float(), KVCache(k.float(), v.float()), *args)
    assert rel_err(plain, ref) > 1e-2  # the biases matter at these lengths


@pytest.mark.parametrize('policy', [4])  # (int4: rotated, centred keys; int8 shares the biases' code path)
def test_quantized_cache(policy):
    h, hkv, d, bs = 4, 2, 64, 16
    kv_lens = [50, 1, 77, 20]
    ref_cache, cache, tables = reference_filled_cache(kv_lens, hkv, d, bs, DTYPE, policy, DEV, head_major=True)
    if policy == 4:
        mean = torch.randn(hkv, d)
        ref_cache.k_mean = mean
        cache.k_mean = mean.to(DEV)
    lens = torch.tensor(kv_lens)
    quant = dict(k_scale_zero=cache.k_scale_zero, v_scale_zero=cache.v_scale_zero, k_mean=cache.k_mean)
    q = torch.randn(len(kv_lens), h, d, dtype=DTYPE)
    ref = REF.paged_decode_attention(q.float(), ref_cache, tables, lens, d**-0.5, max(kv_lens), alibi_slopes=slopes(h))
    out = attention.paged_decode_attention(q.to(DEV), cache.k, cache.v, tables.to(DEV), lens.to(DEV), d**-0.5,
                                           max(kv_lens), num_sms=132, tiles=(16, 1, 4),
                                           alibi_slopes=slopes(h).to(DEV), **quant)
    assert rel_err(out, ref) < (1e-4 if DTYPE == torch.float32 else 1e-2)
    q_lens = [20, 1, 30, 20]
    qp = torch.randn(sum(q_lens), h, d, dtype=DTYPE)
    args = (tables, torch.tensor([0] + q_lens[:-1]).cumsum(0), torch.tensor(q_lens), lens, d**-0.5, max(q_lens),
            max(kv_lens))
    ref = REF.paged_prefill_attention(qp.float(), ref_cache, *args, alibi_slopes=slopes(h))
    out = attention.paged_prefill_attention(qp.to(DEV), cache.k, cache.v, *(a.to(DEV) if torch.is_tensor(a) else a
                                                                            for a in args),
                                            tiles=(16, 16, 4, 2, False), alibi_slopes=slopes(h).to(DEV), **quant)
    assert rel_err(out, ref) < (1e-4 if DTYPE == torch.float32 else 1e-2)


def test_reference_bias_is_alibi():
    """The reference's bias on one head against the formula written out: softmax(scale q.k + m (j - p)) v."""
    d, n = 16, 9
    k, v, tables = paged([n], 1, d, 4)
    q = torch.randn(1, 1, d, dtype=DTYPE)
    m = 0.5
    out = REF.paged_decode_attention(q.float(), KVCache(k.float(), v.float()), tables, torch.tensor([n]), d**-0.5, n,
                                     alibi_slopes=torch.tensor([m]))
    ks = torch.stack([k[int(tables[0, j // 4]), j % 4, 0] for j in range(n)]).double()
    vs = torch.stack([v[int(tables[0, j // 4]), j % 4, 0] for j in range(n)]).double()
    s = ks @ q[0, 0].double() / math.sqrt(d) + m * (torch.arange(n) - (n - 1))
    want = torch.softmax(s, 0) @ vs
    assert torch.allclose(out[0, 0].double(), want, atol=1e-5)


ALIBI_CHECKS = [name for name in check_names() if name.endswith('[alibi]')]


@pytest.mark.parametrize('check', ALIBI_CHECKS)
def test_the_cuda_device_passes_the_alibi_conformance_checks(check):
    [result] = run_self_tests('cuda', ops=here_cuda_ops(), only={check})
    assert result.passed, result.detail
