"""Decode attention at the throughput workload's batch: the kernel in use
against variants that read the paged cache differently.

- ``tokens``: the kernel in lmdeploy (a tile of context tokens gathers its
  page number token by token).
- ``page``: one program walks its sequence page by page: the page number is
  one scalar load, the tile is that page's rows of this KV head.
- ``tma``: as ``page``, but each page's K and V rows arrive through the
  tensor copy engine (Hopper), the cache seen as [blocks * block_size,
  kv_heads * head_dim].

Every variant is checked against the kernel in use, then timed as CUDA graph
replays; the rate is the KV bytes read over the time.

    python benchmark/decode_attn_sweep.py --batch 248 --median 420 --sigma 0.6
    TRITON_INTERPRET=1 python benchmark/decode_attn_sweep.py --check
"""
from __future__ import annotations

import argparse
import math
import os
import random

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_utils import rel_err
from lmdeploy.devices.cuda.kernels import attention

_LOG2E = 1.4426950408889634


@triton.jit
def _page_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, tables_ptr, kv_lens_ptr, order_ptr, k_desc, v_desc, scale_log2,
                 stride_qb, stride_qh, stride_ob, stride_oh, stride_cn, stride_cs, stride_ch, stride_bt,
                 NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, TMA: tl.constexpr, ORDERED: tl.constexpr):
    pid = tl.program_id(0)
    kvh = pid % NUM_KV_HEADS
    b = pid // NUM_KV_HEADS
    if ORDERED:
        b = tl.load(order_ptr + b)
    b = b.to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    g_valid = g < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float('-inf'), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table = tables_ptr + b * stride_bt
    offs_t = tl.arange(0, BLOCK_SIZE)
    rows = (offs_t * stride_cs + kvh * stride_ch)[:, None] + offs_d[None, :]
    for start in range(0, kv_len, BLOCK_SIZE):
        page = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
        valid = start + offs_t < kv_len
        if TMA:
            k = k_desc.load([(page * BLOCK_SIZE).to(tl.int32), kvh * HEAD_DIM])
        else:
            k = tl.load(kc_ptr + page * stride_cn + rows)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(valid[None, :], s, float('-inf'))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if TMA:
            v = v_desc.load([(page * BLOCK_SIZE).to(tl.int32), kvh * HEAD_DIM])
        else:
            v = tl.load(vc_ptr + page * stride_cn + rows)
        v = tl.where(valid[:, None], v, 0.0)  # rows past the context may hold anything, NaN included
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_valid[:, None])


def page_attention(q, k_cache, v_cache, tables, lens, scale, order, tma, warps, stages):
    bsz, h, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    if tma:
        kd = TensorDescriptor.from_tensor(k_cache.view(nb * bs, hkv * d), [bs, d])
        vd = TensorDescriptor.from_tensor(v_cache.view(nb * bs, hkv * d), [bs, d])
    else:
        kd = vd = 0
    _page_kernel[(bsz * hkv, )](q, k_cache, v_cache, out, tables, lens, order if order is not None else lens, kd, vd,
                                scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
                                NUM_KV_HEADS=hkv, GROUP=h // hkv, BLOCK_G=max(16, triton.next_power_of_2(h // hkv)),
                                BLOCK_SIZE=bs, HEAD_DIM=d, TMA=tma, ORDERED=order is not None, num_warps=warps,
                                num_stages=stages)
    return out


def make_batch(batch, lengths, h, hkv, d, bs, device, dtype, seed=0):
    """A paged cache whose blocks are handed out in random order (as a busy
    cache hands them out), NaN in every slot no sequence owns."""
    rng = random.Random(seed)
    need = [-(-n // bs) for n in lengths]
    blocks = list(range(sum(need) + 8))
    rng.shuffle(blocks)
    width = max(need)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(blocks[at:at + n], dtype=torch.int32)
        at += n
    shape = (len(blocks), bs, hkv, d)
    k_cache = torch.full(shape, float('nan'), dtype=dtype, device=device)
    v_cache = torch.full(shape, float('nan'), dtype=dtype, device=device)
    for i, n in enumerate(lengths):
        for j in range(need[i]):
            rows = min(bs, n - j * bs)
            blk = int(tables[i, j])
            k_cache[blk, :rows] = torch.randn(rows, hkv, d, dtype=dtype, device=device)
            v_cache[blk, :rows] = torch.randn(rows, hkv, d, dtype=dtype, device=device)
    q = torch.randn(batch, h, d, dtype=dtype, device=device)
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    order = torch.tensor(sorted(range(batch), key=lambda i: -lengths[i]), dtype=torch.int64, device=device)
    return q, k_cache, v_cache, tables.to(device), lens, order


def check(device, dtype) -> bool:
    """Both variants against the kernel in use: contexts of 1 token, a page
    and a token past one, and slots no sequence owns holding NaN."""
    lengths = [1, 17, 64, 65, 130]
    q, kc, vc, tables, lens, order = make_batch(len(lengths), lengths, 8, 2, 64, 16, device, dtype)
    want = attention.paged_decode_attention(q, kc, vc, tables, lens, 0.125, max(lengths), 4, order)
    for tma in (False, True):
        got = page_attention(q, kc, vc, tables, lens, 0.125, order, tma, 4, 2)
        err = rel_err(got, want)
        assert err < 1e-2 and torch.isfinite(got).all(), (tma, err)
    return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--batch', type=int, default=248)
    p.add_argument('--median', type=int, default=420)
    p.add_argument('--sigma', type=float, default=0.6)
    p.add_argument('--block-size', type=int, default=64)
    p.add_argument('--check', action='store_true', help='correctness only, small shapes (works interpreted)')
    args = p.parse_args()
    if args.check:
        check(*(('cpu', torch.float32) if os.environ.get('TRITON_INTERPRET') == '1' else ('cuda', torch.float16)))
        print('ok')
        return
    from triton.testing import do_bench_cudagraph
    rng = random.Random(1)
    for label, lengths in [
        (f'lognormal median {args.median} sigma {args.sigma}', [
            min(4000, max(8, int(rng.lognormvariate(math.log(args.median), args.sigma)))) for _ in range(args.batch)]),
        ('all 512', [512] * args.batch)]:
        q, kc, vc, tables, lens, order = make_batch(args.batch, lengths, 32, 8, 128, args.block_size, 'cuda',
                                                    torch.bfloat16)
        gb = sum(lengths) * 8 * 128 * 2 * 2 / 1e9
        want = attention.paged_decode_attention(q, kc, vc, tables, lens, 0.088, max(lengths), 132, order)
        base = 1e3 * do_bench_cudagraph(
            lambda: attention.paged_decode_attention(q, kc, vc, tables, lens, 0.088, max(lengths), 132, order))
        print(f'batch {args.batch}, {label}: {gb * 1e3:.0f} MB of KV; tokens (in use) {base:6.1f} us '
              f'{gb / base * 1e6 / 1e3:.2f} TB/s', flush=True)
        results = []
        for tma in (False, True):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4, 5):
                    def run():
                        return page_attention(q, kc, vc, tables, lens, 0.088, order, tma, warps, stages)
                    try:
                        got = run()
                    except Exception as e:
                        print(f'  tma={tma} warps={warps} stages={stages}: {type(e).__name__} {str(e)[:100]}')
                        continue
                    err = rel_err(got, want)
                    if not (err < 1e-2):
                        print(f'  tma={tma} warps={warps} stages={stages}: WRONG ({err:.3g})')
                        continue
                    results.append((1e3 * do_bench_cudagraph(run), tma, warps, stages))
        results.sort()
        for us, tma, warps, stages in results[:6]:
            print(f'  {"tma " if tma else "page"} warps={warps} stages={stages}: {us:6.1f} us '
                  f'{gb / us * 1e6 / 1e3:.2f} TB/s ({base / us:.2f}x)', flush=True)


if __name__ == '__main__':
    main()
