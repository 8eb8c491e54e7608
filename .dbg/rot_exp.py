"""Experiment: does a Hadamard rotation of K (and V) bring int4 KV ppl within 5 %?"""
import math, sys, time
import torch
sys.path.insert(0, 'benchmark')
import kv_quant_quality as Q
from lmdeploy.devices import reference as R

MODE = sys.argv[1]  # none | k | kv
CLIP = [float(r) for r in sys.argv[2].split(',')] if len(sys.argv) > 2 else [1.0]
from lmdeploy.devices import cache as C
orig_q = C.quantize
def quantize(x, bits):
    if bits != 4 or CLIP == [1.0]:
        return orig_q(x, bits)
    levels = 15
    xf = x.float()
    lo0, hi0 = xf.amin(-1), xf.amax(-1)
    best = None
    for r in CLIP:
        mid = (lo0 + hi0) / 2
        lo = mid - r * (mid - lo0); hi = mid + r * (hi0 - mid)
        zero = lo.to(torch.float16)
        scale = ((hi - lo) / levels).to(torch.float16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((xf - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, levels)
        err = ((codes * scale.float()[..., None] + zero.float()[..., None] - xf) ** 2).sum(-1)
        if best is None:
            best = [err, codes, scale, zero]
        else:
            take = err < best[0]
            best[0] = torch.where(take, err, best[0])
            best[1] = torch.where(take[..., None], codes, best[1])
            best[2] = torch.where(take, scale, best[2]); best[3] = torch.where(take, zero, best[3])
    return best[1].to(torch.uint8), torch.stack([best[2], best[3]], dim=-1)
R.quantize = quantize

def hadamard(d):
    i = torch.arange(d)
    x = i[:, None] & i[None, :]
    par = torch.zeros_like(x)
    while x.any():
        par ^= x & 1
        x = x >> 1
    return (1 - 2 * par).float() / math.sqrt(d)

orig_fill = R.ReferenceOps.fill_kv_cache
orig_pre = R.ReferenceOps.paged_prefill_attention
orig_dec = R.ReferenceOps.paged_decode_attention
def rot(x):
    H = hadamard(x.shape[-1]).to(x.dtype)
    return x @ H
def fill(self, k, v, cache, slots):
    if cache.quant_policy == 4:
        k = rot(k)
        if MODE == 'kv': v = rot(v)
    return orig_fill(self, k, v, cache, slots)
def pre(self, q, cache, block_tables, q_start_loc, q_seqlens, kv_seqlens, scale, max_q_len, max_kv_len, out=None):
    a = (block_tables, q_start_loc, q_seqlens, kv_seqlens, scale, max_q_len, max_kv_len); kw = {}
    if cache.quant_policy != 4: return orig_pre(self, q, cache, *a, out=out, **kw)
    o = orig_pre(self, rot(q), cache, *a, **kw)
    if MODE == 'kv': o = rot(o)  # H symmetric orthogonal: H^T = H
    if out is None: return o
    return out.copy_(o)
def dec(self, q, cache, block_tables, kv_seqlens, scale, max_kv_len, order=None, out=None):
    a = (block_tables, kv_seqlens, scale, max_kv_len, order); kw = {}
    if cache.quant_policy != 4: return orig_dec(self, q, cache, *a, out=out, **kw)
    o = orig_dec(self, rot(q), cache, *a, **kw)
    if MODE == 'kv': o = rot(o)
    if out is None: return o
    return out.copy_(o)
if MODE != 'none':
    R.ReferenceOps.fill_kv_cache = fill
    R.ReferenceOps.paged_prefill_attention = pre
    R.ReferenceOps.paged_decode_attention = dec
from lmdeploy.default_model import resolve_model_path
t = time.time()
res = Q.measure(resolve_model_path(None), 'cpu', 'float32', [4], 20480, 2048, 8, 128, 64)
print(MODE, res, time.time() - t)
