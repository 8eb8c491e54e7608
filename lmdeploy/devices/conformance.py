"""The conformance suite: every device's ops against an independent float64 computation.

One suite for every device, built-in or registered: the tests run it on
each device available in the process (tests/test_conformance.py,
parametrized by device and check), and ``lmdeploy check_env`` runs it on
each available device. Each op gets small random inputs; the expected
result is computed in float64 on the CPU from the documented meaning of
the op (not by calling the reference ops), so the reference is checked too.
"""
from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass
from typing import Callable, List, Tuple


@dataclass
class TestResult:
    device: str
    op: str
    passed: bool
    detail: str


def _tolerance(dtype) -> Tuple[float, float]:
    import torch
    return {torch.float32: (2e-3, 2e-3), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}[dtype]


def _compare(name: str, got, ref, dtype) -> Tuple[bool, str]:
    import torch
    got = got.detach().to('cpu', torch.float64)
    if got.shape != ref.shape:
        return False, f'shape {tuple(got.shape)} != expected {tuple(ref.shape)}'
    if not torch.isfinite(got).all():
        return False, 'non-finite values'
    atol, rtol = _tolerance(dtype)
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    ratio = float((err / bound).max())  # <= 1 passes
    return ratio <= 1.0, (f'max abs err {float(err.max()):.1e}, {100 * ratio:.0f}% of tolerance '
                          f'(atol {atol:g}, rtol {rtol:g})')


def test_dtype(ops):
    """The dtype a device is checked in: float32 where it runs it, else bf16, else fp16."""
    import torch
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        try:
            if ops.supports_dtype(dt):
                return dt
        except Exception:
            continue
    return torch.float16


def checks(ops, dev, dtype) -> List[Tuple[str, Callable[[], Tuple[bool, str]]]]:
    """(op name, callable -> (passed, detail)) for one device."""
    import torch
    g = torch.Generator().manual_seed(1234)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    def on_dev(t, dt=None):
        return t.to(dtype if dt is None else dt).to(dev)

    def q64(t):  # the exact values the device sees, in float64
        return t.to(dtype).to(torch.float64)

    def _all_ok(*checks):
        """(ok, detail) of several comparisons: the first failure's detail, else the first one's."""
        bad = [c for c in checks if not c[0]]
        return (False, bad[0][1]) if bad else (True, checks[0][1])

    def rms_norm():
        eps = 1e-6
        x, res, w = q64(randn(5, 64, scale=2)), q64(randn(5, 64)), q64(randn(64) + 1)
        out, h_out = ops.rms_norm(on_dev(x), on_dev(w), eps, on_dev(res))
        h = x + res
        ref = w * h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
        ok2, d2 = _compare('rms_norm residual', h_out, h, dtype)
        return _all_ok(_compare('rms_norm', out, ref, dtype), (ok2, f'residual: {d2}'))

    def silu_and_mul():
        x = q64(randn(7, 2 * 48))
        out = ops.silu_and_mul(on_dev(x))
        gate, up = x[:, :48], x[:, 48:]
        return _compare('silu_and_mul', out, gate / (1 + torch.exp(-gate)) * up, dtype)

    def gelu_tanh_and_mul():
        # its own generator: the inputs of the checks after it stay what they were
        x = q64(torch.randn(7, 2 * 48, generator=torch.Generator().manual_seed(4321), dtype=torch.float64) * 2)
        out = ops.gelu_tanh_and_mul(on_dev(x))
        gate, up = x[:, :48], x[:, 48:]
        gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi)**0.5 * (gate + 0.044715 * gate**3)))
        return _compare('gelu_tanh_and_mul', out, gelu * up, dtype)

    def gelu(approximate):
        x = q64(torch.randn(5, 40, generator=torch.Generator().manual_seed(4322), dtype=torch.float64) * 3)
        out = ops.gelu(on_dev(x), approximate)
        if approximate == 'tanh':
            want = 0.5 * x * (1 + torch.tanh((2 / torch.pi)**0.5 * (x + 0.044715 * x**3)))
        else:
            want = 0.5 * x * (1 + torch.erf(x / 2**0.5))
        return _compare(f'gelu[{approximate}]', out, want, dtype)

    def layer_norm():
        g2 = torch.Generator().manual_seed(4323)  # its own generator, as gelu_tanh_and_mul's
        eps = 1e-5
        # an offset mean and a width that is not a power of two (masked columns in a kernel's block)
        x = q64(torch.randn(5, 72, generator=g2, dtype=torch.float64) * 2 + 3)
        w = q64(torch.randn(72, generator=g2, dtype=torch.float64) * 0.3 + 1)
        b = q64(torch.randn(72, generator=g2, dtype=torch.float64) * 0.5)
        out = ops.layer_norm(on_dev(x), on_dev(w), on_dev(b), eps)
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean)**2).mean(-1, keepdim=True)
        return _compare('layer_norm', out, (x - mean) / torch.sqrt(var + eps) * w + b, dtype)

    def _rotary_setup(T=6, H=4, Hkv=2, D=16):
        """q, k, cos, sin of positions 0..T-1, and the reference rotation."""
        q, k = q64(randn(T, H, D)), q64(randn(T, Hkv, D))
        pos = torch.arange(T, dtype=torch.float64)[:, None]
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = torch.cat([pos * inv, pos * inv], dim=-1)
        cos, sin = on_dev(torch.cos(ang), torch.float32), on_dev(torch.sin(ang), torch.float32)

        def ref(x):  # complex rotation of (x[i], x[i + D/2]) pairs
            z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * torch.exp(1j * (pos * inv))[:, None, :]
            return torch.cat([z.real, z.imag], dim=-1)

        return q, k, cos, sin, ref

    def apply_rotary():
        q, k, cos, sin, ref = _rotary_setup()
        qo, ko = ops.apply_rotary(on_dev(q), on_dev(k), cos, sin)
        return _all_ok(_compare('q', qo, ref(q), dtype), _compare('k', ko, ref(k), dtype))

    def cache_spec(S, Hkv, D, policy=0):
        return ops.kv_cache_spec(Hkv, D, S, dtype, policy)

    def cache_of(num_blocks, S, Hkv, D, policy=0):
        return cache_spec(S, Hkv, D, policy).allocate(num_blocks, dev)

    def rotary_fill_kv():
        T, Hkv, D, S = 6, 2, 16, 4
        q, k, cos, sin, ref = _rotary_setup(T, Hkv=Hkv, D=D)
        v = q64(randn(T, Hkv, D))
        cache = cache_of(4, S, Hkv, D)
        slots = torch.randperm(4 * S, generator=g)[:T]
        qo, ko = ops.rotary_fill_kv(on_dev(q), on_dev(k), on_dev(v), cos, sin, cache, slots.to(dev))
        kc, vc = cache.k.flatten(0, 1)[slots.to(dev)], cache.v.flatten(0, 1)[slots.to(dev)]
        return _all_ok(_compare('q', qo, ref(q), dtype), _compare('k', ko, ref(k), dtype),
                       _compare('k cache', kc, ref(k), dtype), _compare('v cache', vc, v, dtype))

    def argmax():
        x = randn(4, 3000, scale=3).float()
        x[1, 17] = x[1, 2900] = x[1].max() + 1  # a tie: the first index wins
        x[2] = float('-inf')
        got = ops.argmax(x.to(dev)).cpu().tolist()
        want = [int(x[0].argmax()), 17, 0, int(x[3].argmax())]
        return got == want, f'indices {got}' + ('' if got == want else f' != expected {want}')

    def _paged_setup(kv_lens, H=4, Hkv=2, D=32, S=4, num_blocks=None, policy=0):
        """Random per-sequence K/V written through fill_kv_cache into shuffled blocks; returns the K/V
        attention must see (after the cache's quantize-then-dequantize, devices/cache.py; int4's K through
        the Hadamard basis and back), the cache, the tables. A quantized cache of the standard tensors (stored
        token- or head-major: read through its views) is read back as written: a device that rotates int4's
        K in another summation order may round a code the other way, a whole int4 step, and attention is
        checked against what it was given."""
        from .cache import dequantize, hadamard, quantize, rotates_k, standard_spec, unpack_int4
        num_blocks = num_blocks or max(16, sum(-(-n // S) for n in kv_lens) + 4)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        max_blocks = max((n + S - 1) // S for n in kv_lens)
        tables = torch.zeros(len(kv_lens), max_blocks, dtype=torch.int32)
        ks, vs, slots = [], [], []
        for b, n in enumerate(kv_lens):
            nb = (n + S - 1) // S
            blocks = [perm.pop() for _ in range(nb)]
            tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
            ks.append(q64(randn(n, Hkv, D)))
            vs.append(q64(randn(n, Hkv, D)))
            slots += [blocks[j // S] * S + j % S for j in range(n)]
        cache = cache_of(num_blocks, S, Hkv, D, policy)
        mean = None
        if cache_spec(S, Hkv, D, policy).centres_keys:  # int4's mean key, measured by the engine at start-up
            cache.set_key_mean(q64(randn(Hkv, D, scale=2)).float())
            mean = cache.k_mean.cpu().double()
        fill_ok = (True, '')
        ops.fill_kv_cache(on_dev(torch.cat(ks)), on_dev(torch.cat(vs)), cache,
                          torch.tensor(slots, dtype=torch.int64, device=dev))
        if policy:
            h = hadamard(D).double() if rotates_k(policy, D) else None
            if cache_spec(S, Hkv, D, policy).tensors == standard_spec(Hkv, D, S, dtype, policy).tensors:
                at = [torch.tensor(slots[sum(kv_lens[:b]):sum(kv_lens[:b + 1])]) for b in range(len(kv_lens))]

                def stored(data, scale_zero):
                    codes = data.cpu().flatten(0, 1)
                    codes = codes if policy == 8 else unpack_int4(codes)
                    sz = scale_zero.cpu().flatten(0, 1)
                    return [dequantize(codes[i], sz[i]).double() for i in at]
                written = ks
                ks, vs = stored(cache.k, cache.k_scale_zero), stored(cache.v, cache.v_scale_zero)
                if mean is not None:  # each stored key within a step of its codes' range from k H - mean
                    steps = cache.k_scale_zero.cpu().flatten(0, 1).double()[..., :1]
                    err = max(float(((y - ((x.double() @ h if h is not None else x.double()) - mean)).abs()
                                     / steps[i]).max()) for x, y, i in zip(written, ks, at))
                    fill_ok = (err <= 1.01, f'int4 K stored less its mean: off by {err:.2f} of a step at most')
                    ks = [x + mean for x in ks]
            else:
                vs = [dequantize(*quantize(x.to(dtype), policy)).double() for x in vs]
                ks = [dequantize(*quantize(x.to(dtype).float() @ h.float() if h is not None else x.to(dtype),
                                          policy)).double() for x in ks]
            if h is not None:
                ks = [x @ h for x in ks]
        return ks, vs, cache, tables.to(dev), fill_ok

    def _attend_ref(q, k, v, scale, n_visible, window=None, softcap=None, alibi=None):
        """q [H, D] of one position, k/v [L, Hkv, D]: softmax over the first n_visible keys (the last
        ``window`` of them), scores soft-capped as cap * tanh(s / cap), then ALiBi's slope_h * (j - p) added
        (``alibi``: the H slopes; the query sits at p = n_visible - 1)."""
        H, Hkv = q.shape[0], k.shape[1]
        first = 0 if window is None else max(0, n_visible - window)
        out = torch.empty_like(q)
        for h in range(H):
            kh, vh = k[first:n_visible, h // (H // Hkv)], v[first:n_visible, h // (H // Hkv)]
            s = (kh @ q[h]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if alibi is not None:
                s = s + alibi[h] * (torch.arange(first, n_visible, dtype=s.dtype) - (n_visible - 1))
            p = torch.exp(s - s.max())
            out[h] = (p / p.sum()) @ vh
        return out

    def _variant_args(window, softcap, alibi):
        """The op's keyword arguments for the variant (none for plain attention)."""
        extra = {} if window is None and softcap is None else dict(sliding_window=window, logit_softcap=softcap)
        if alibi is not None:
            extra['alibi_slopes'] = torch.tensor(alibi, dtype=torch.float32, device=dev)
        return extra

    def paged_decode_attention(policy=0, D=32, window=None, softcap=None, kv_lens=(5, 11, 1), q_scale=1.0,
                               alibi=None):
        kv_lens = list(kv_lens)
        H = 4
        ks, vs, cache, tables, fill_ok = _paged_setup(kv_lens, H=H, D=D, policy=policy)
        q = q64(randn(len(kv_lens), H, D, scale=q_scale))
        scale = 1 / math.sqrt(D)
        lens = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        ref = torch.stack([_attend_ref(q[b], ks[b], vs[b], scale, n, window, softcap, alibi)
                           for b, n in enumerate(kv_lens)])
        longest_first = torch.tensor(sorted(range(len(kv_lens)), key=lambda b: -kv_lens[b]), device=dev)
        extra = _variant_args(window, softcap, alibi)
        return _all_ok(*(_compare('paged_decode_attention', ops.paged_decode_attention(
            on_dev(q), cache, tables, lens, scale, max(kv_lens), order, **extra), ref, dtype)
                         for order in (None, longest_first)), fill_ok)  # a work-order hint: same results

    def paged_prefill_attention(policy=0, D=32, window=None, softcap=None, kv_lens=(9, 4), q_lens=(3, 4),
                                q_scale=1.0, alibi=None):
        kv_lens, q_lens = list(kv_lens), list(q_lens)  # the first continues a cached prefix (chunked prefill)
        H = 4
        ks, vs, cache, tables, fill_ok = _paged_setup(kv_lens, H=H, D=D, policy=policy)
        q = q64(randn(sum(q_lens), H, D, scale=q_scale))
        starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
        scale = 1 / math.sqrt(D)
        i32 = dict(dtype=torch.int32, device=dev)
        extra = _variant_args(window, softcap, alibi)
        out = ops.paged_prefill_attention(on_dev(q), cache, tables, torch.tensor(starts, **i32),
                                          torch.tensor(q_lens, **i32), torch.tensor(kv_lens, **i32), scale,
                                          max(q_lens), max(kv_lens), **extra)
        ref = torch.empty_like(q)
        for b, (st, ql, kl) in enumerate(zip(starts, q_lens, kv_lens)):
            for i in range(ql):
                ref[st + i] = _attend_ref(q[st + i], ks[b], vs[b], scale, kl - ql + i + 1, window, softcap, alibi)
        return _all_ok(_compare('paged_prefill_attention', out, ref, dtype), fill_ok)

    # sliding window (4 tokens, shorter than most contexts: blocks wholly outside it, chunks that cross it) and
    # soft-capped scores (q scaled so that the cap bites: scores around +-10 against a cap of 5), at the head
    # sizes models use
    windowed = dict(decode=dict(kv_lens=(5, 11, 1, 30)), prefill=dict(kv_lens=(13, 6, 30), q_lens=(5, 6, 2)))

    def attention_variant(op, policy, softcap):
        fn, shapes = (paged_decode_attention, windowed['decode']) if op == 'decode' else (
            paged_prefill_attention, windowed['prefill'])
        cap = dict(softcap=5.0, q_scale=3.0) if softcap else {}
        return _all_ok(*(fn(policy, D=d, window=4, **cap, **shapes) for d in (64, 128, 256)))

    # ALiBi (Baichuan-13B's slopes for 4 heads, 2^-2 to 2^-8, and contexts long enough that the far keys' bias
    # outweighs their scores), without a window as its models use it
    def attention_alibi(op, policy):
        fn = paged_decode_attention if op == 'decode' else paged_prefill_attention
        shapes = dict(kv_lens=(5, 70, 1, 33)) if op == 'decode' else dict(kv_lens=(70, 6, 33), q_lens=(37, 6, 2))
        return _all_ok(*(fn(policy, D=d, alibi=[2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8], **shapes) for d in (64, 128)))

    def apply_token_bitmask():
        logits = randn(3, 70, scale=3).float()
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
        bitmask[2] = -1  # every bit set: nothing masked
        got = ops.apply_token_bitmask(logits.to(dev), bitmask.to(dev)).cpu()
        allowed = torch.tensor([[(int(bitmask[b, t // 32]) >> (t % 32)) & 1 for t in range(70)] for b in range(3)],
                               dtype=torch.bool)
        want = torch.where(allowed, logits, torch.full_like(logits, float('-inf')))
        ok = torch.equal(got, want)
        return ok, f'{int((~allowed).sum())} of {allowed.numel()} masked' + ('' if ok else ', differs from expected')

    def _history(rows: int, vocab: int):
        """Token ids with repeats, padded with -1 (row 0 has none at all)."""
        ids = torch.randint(0, vocab, (rows, 9), generator=g)
        ids[:, 6:] = ids[:, :3]  # repeats
        ids[0] = -1
        ids[1, 7:] = -1
        return ids

    def apply_repetition_penalty():
        logits, ids = randn(3, 40, scale=3).float(), _history(3, 40)
        penalty = torch.tensor([1.3, 0.7, 2.0])
        got = ops.apply_repetition_penalty(logits.clone().to(dev), ids.to(dev), penalty.to(dev)).cpu()
        want = logits.clone()
        for b in range(3):
            for t in set(ids[b].tolist()) - {-1}:
                x = float(logits[b, t])
                want[b, t] = x / float(penalty[b]) if x > 0 else x * float(penalty[b])
        return _compare('apply_repetition_penalty', got.double(), want.double(), torch.float32)

    def apply_frequency_presence_penalty():
        logits, ids = randn(3, 40, scale=3).float(), _history(3, 40)
        frequency, presence = torch.tensor([0.5, -1.25, 2.0]), torch.tensor([1.5, 0.75, -2.0])
        got = ops.apply_frequency_presence_penalty(logits.clone().to(dev), ids.to(dev), frequency.to(dev),
                                                   presence.to(dev)).cpu()
        want = logits.double().clone()
        for b in range(3):
            row = [t for t in ids[b].tolist() if t >= 0]
            for t in set(row):
                want[b, t] -= row.count(t) * float(frequency[b]) + float(presence[b])
        return _compare('apply_frequency_presence_penalty', got.double(), want, torch.float32)

    def quantized_activation(op, fp8):
        """``op``'s QuantizedInput against the reference's codes of the float values it stands for (the device's
        own float op: act_quant.py's rule applied to them): the same scales, codes at most one step apart
        (an int8 code; an e4m3 spacing at the value), zeros past the rows."""
        from .act_quant import quantize_input, steps_apart
        x, res, w = q64(randn(5, 64, scale=2)), q64(randn(5, 64)), q64(randn(64) + 1)
        x2 = q64(randn(6, 2 * 40))
        if op == 'quantize_per_token':
            x[0, 7] = 40.0  # an outlier: the other codes of its row near zero
            qi, fl = ops.quantize_per_token(on_dev(x), fp8), on_dev(x)
        elif op == 'rms_norm_quant':
            qi, h = ops.rms_norm_quant(on_dev(x), on_dev(w), 1e-6, on_dev(res), fp8)
            fl, h_want = ops.rms_norm(on_dev(x), on_dev(w), 1e-6, on_dev(res))
            ok, detail = _compare('rms_norm_quant residual', h, h_want.to(torch.float64).cpu(), dtype)
            if not ok:
                return ok, detail
        else:
            qi, fl = ops.silu_and_mul_quant(on_dev(x2), fp8), ops.silu_and_mul(on_dev(x2))
        want = quantize_input(fl.cpu(), fp8)
        if (qi.rows, tuple(qi.shape), qi.dtype, qi.fp8) != (want.rows, tuple(want.shape), want.dtype, fp8):
            return False, (f'{qi.rows} rows of shape {tuple(qi.shape)}, {qi.dtype}, fp8 {qi.fp8}; expected '
                           f'{want.rows} of {tuple(want.shape)}, {want.dtype}, fp8 {fp8}')
        got_q, got_s = qi.q.cpu(), qi.scale.cpu().double()
        if got_q[qi.rows:].double().abs().sum() != 0:
            return False, 'rows past the input are not zeros'
        scale_err = float(((got_s[:qi.rows] - want.scale.double()).abs() / want.scale.double()).max())
        steps = float(steps_apart(got_q[:qi.rows], want.q, fp8).max())
        detail = f'codes at most {steps:.2f} steps apart, scales {scale_err:.1e} apart (relative)'
        return steps <= 1.0 and scale_err <= 1e-6, detail

    def sample():
        from lmdeploy.devices import rng
        logits = randn(3, 50, scale=3).float()
        seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
        offsets = torch.tensor([0, 5, 17], dtype=torch.int64)
        got = ops.sample(logits.to(dev), seeds.to(dev), offsets.to(dev)).cpu().tolist()
        # exponential race in float64 with the shared counter-based uniforms
        p = torch.softmax(logits.double(), -1)
        u = rng.uniform(seeds, offsets, 50).double()
        want = (p / -torch.log(u)).argmax(-1).tolist()
        return got == want, f'tokens {got}' + ('' if got == want else f' != expected {want}')

    found = [('rms_norm', rms_norm), ('silu_and_mul', silu_and_mul), ('gelu_tanh_and_mul', gelu_tanh_and_mul),
             ('gelu[none]', lambda: gelu('none')), ('gelu[tanh]', lambda: gelu('tanh')), ('layer_norm', layer_norm),
             ('apply_rotary', apply_rotary), ('rotary_fill_kv', rotary_fill_kv), ('argmax', argmax),
             ('paged_decode_attention', paged_decode_attention),
             ('paged_prefill_attention', paged_prefill_attention), ('apply_token_bitmask', apply_token_bitmask),
             ('apply_repetition_penalty', apply_repetition_penalty),
             ('apply_frequency_presence_penalty', apply_frequency_presence_penalty), ('sample', sample)]
    found += [(f'{op}[{"fp8" if fp8 else "int8"}]', lambda o=op, f=fp8: quantized_activation(o, f))
              for op in ('quantize_per_token', 'rms_norm_quant', 'silu_and_mul_quant') for fp8 in (False, True)]
    attention = [('paged_decode_attention', paged_decode_attention),
                 ('paged_prefill_attention', paged_prefill_attention)]
    for policy in (8, 4):  # the quantized caches this device implements (devices/cache.py)
        if policy in ops.quant_policies:
            found += [(f'{name}[int{policy}]', lambda fn=fn, p=policy: fn(p)) for name, fn in attention]
    for policy in (0, 8, 4):  # window alone, window with soft-capping; head_dim 64 / 128 / 256
        if policy in ops.quant_policies:
            cache = '' if policy == 0 else f',int{policy}'
            found += [(f'paged_{op}_attention[{kind}{cache}]', lambda o=op, p=policy, c=capped: attention_variant(
                o, p, c)) for op in ('decode', 'prefill') for kind, capped in (('window', False), ('softcap', True))]
            found += [(f'paged_{op}_attention[alibi{cache}]', lambda o=op, p=policy: attention_alibi(o, p))
                      for op in ('decode', 'prefill')]
    from .layers import REFERENCE_IMPLS  # every layer kind in every weight format
    found += [(f'layer:{kind}[{fmt}]', lambda k=kind, f=fmt: check_layer_impl(ops, k, f, dtype))
              for kind, fmt in sorted(REFERENCE_IMPLS)]
    return found


def _random_like(p, g):
    """Random values for a parameter of a layer implementation, by its dtype: any bits for int32 ones (int4
    values packed eight to an element), small integers for other integer parameters, normal values for float
    ones (the caller makes those named as scales positive)."""
    import torch
    if p.dtype == torch.int32:
        return torch.randint(-2**31, 2**31, tuple(p.shape), generator=g, dtype=torch.int64).to(torch.int32)
    if not p.dtype.is_floating_point:
        info = torch.iinfo(p.dtype)
        return torch.randint(max(info.min, -127), min(info.max, 127) + 1, tuple(p.shape), generator=g).to(p.dtype)
    return torch.randn(tuple(p.shape), generator=g, dtype=torch.float64)


# per layer kind: (arguments of create_weights, a random input, how the layer is applied to it)
def _layer_case(kind: str, g):
    import torch
    if kind in ('linear', 'lm_head'):
        in_f, out_f = 48, 40
        # inputs of a normed layer's size (outputs of a few units): in bf16 a product of two outputs in the
        # hundreds (gate * up) is off by more than its own 5% wherever the gate is near zero
        x = torch.randn(7, in_f, generator=g, dtype=torch.float64) / in_f ** 0.5
        return (in_f, out_f, kind == 'linear'), x, lambda impl, layer, x: impl.apply(layer, x)
    if kind == 'embedding':
        ids = torch.tensor([3, 0, 39, 3, 17], dtype=torch.int64)
        return (40, 24), ids, lambda impl, layer, ids: impl.apply(layer, ids)
    if kind == 'norm':
        x = torch.randn(6, 64, generator=g, dtype=torch.float64) * 2
        return (64, ), x, lambda impl, layer, x: impl.apply(layer, x, 1e-6)[0]
    if kind == 'experts':  # 9 tokens, 2 of 5 experts each (expert 4 chosen by none), random router weights
        x = torch.randn(9, 32, generator=g, dtype=torch.float64) / 32 ** 0.5
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
        w = torch.rand(9, 2, generator=g, dtype=torch.float64)

        def run(impl, layer, x):
            return impl.apply(layer, x, w.to(x.dtype).to(x.device), ids.to(x.device))
        return (5, 32, 24), x, run
    if kind == 'rotary':  # positions past 1k, rotary on 12 of 16 dims (4 pass through), LongRoPE's factor
        pos = torch.tensor([0, 1, 5, 1029, 77], dtype=torch.int64)
        inv_freq = torch.rand(6, generator=g) * 0.5

        def run(impl, layer, pos):
            cos, sin = impl.apply(layer, pos, inv_freq.to(pos.device), 16, 1.25)
            return torch.cat([cos, sin], -1)
        return (), pos, run
    if kind == 'attention':
        return (), torch.randn(7, 4, 16, generator=g, dtype=torch.float64), _attention_layer_run(g)
    return None


def _attention_layer_run(g):
    """One step of an attention layer: sequence 0 continues a cached prefix of 4 tokens with 3 new ones,
    sequence 1 is a fresh 4-token prompt (4 query heads over 2 KV heads of 16, blocks of 4, rotary tables of
    random angles): the new K/V written and rotated as the implementation does it, then attended."""
    import torch

    from .attention_meta import AttentionMeta
    k, v = (torch.randn(11, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    angles = torch.rand(7, 8, generator=g, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    tables = torch.tensor([[5, 2], [0, 7]], dtype=torch.int32)  # sequence 0: positions 0-7, 1: 0-3
    # sequence 0's prefix sits at positions 0-3 (block 5), its new tokens at 4-6 (block 2); sequence 1's at 0-3
    prefix_slots = [5 * 4 + j for j in range(4)]
    new_slots = [2 * 4 + j for j in range(3)] + [0 * 4 + j for j in range(4)]

    def run(impl, layer, q):
        dev, dt = q.device, q.dtype
        ops = impl.ops
        cache = ops.kv_cache_spec(2, 16, 4, dt).allocate(8, dev)
        ops.fill_kv_cache(k[:4].to(dt).to(dev), v[:4].to(dt).to(dev), cache,
                          torch.tensor(prefix_slots, device=dev))
        i64 = dict(dtype=torch.int64, device=dev)
        meta = AttentionMeta(is_decode=False, q_start_loc=torch.tensor([0, 3], **i64),
                             q_seqlens=torch.tensor([3, 4], **i64), kv_seqlens=torch.tensor([7, 4], **i64),
                             block_tables=tables.to(dev), slot_mapping=torch.tensor(new_slots, **i64),
                             max_q_len=4, max_kv_len=7)
        layer.scale = 0.25
        return impl.apply(layer, q, k[4:].to(dt).to(dev), v[4:].to(dt).to(dev), cos.float().to(dev),
                          sin.float().to(dev), meta, cache, {})
    return run


def check_layer_impl(ops, kind: str, weight_format: str, dtype=None) -> Tuple[bool, str]:
    """The device's implementation of a ``kind`` layer for ``weight_format`` against the reference's (plain
    torch in float64) on the same random parameters and input, in each of the format's example
    quantization_configs (group sizes, ...)."""
    from .layers import REFERENCE_IMPLS
    configs = getattr(REFERENCE_IMPLS[(kind, weight_format)], 'example_configs', ({}, ))
    ok, detail = True, ''
    for config in configs:
        ok, detail = _check_layer_impl(ops, kind, weight_format, dtype, config)
        if not ok:
            return ok, (f'{detail} (quantization_config {config})' if config else detail)
    return ok, detail


def _check_layer_impl(ops, kind: str, weight_format: str, dtype, config) -> Tuple[bool, str]:
    import torch
    from torch import nn

    from .layers import REFERENCE_IMPLS, param_layout
    from .reference import ReferenceOps
    dtype = dtype or test_dtype(ops)
    dev = ops.torch_device()
    g = torch.Generator().manual_seed(4321)
    case = _layer_case(kind, g)
    if case is None:
        return False, f'no check for {kind} layers'
    args, x, run = case
    mine, ref = nn.Module(), nn.Module()
    impl = ops.layer_impl(kind, weight_format, config) if config else ops.layer_impl(kind, weight_format)
    ref_cls = REFERENCE_IMPLS[(kind, weight_format)]
    ref_impl = ref_cls(ReferenceOps(), config) if config else ref_cls(ReferenceOps())
    impl.create_weights(mine, *args)
    ref_impl.create_weights(ref, *args)
    for name, p in ref.named_parameters():
        value = getattr(ref_impl, 'example_value', lambda *a: None)(ref, name, g)
        value = _random_like(p, g) if value is None else value
        if name.endswith(('scale', 'scales')):
            value = value.abs() / 50 + 1e-3
        ref_p, my_p = getattr(ref, name), getattr(mine, name)
        keep = param_layout(mine, name).keep_dtype
        ref_p.data = value.to(p.dtype if keep else torch.float64)
        my_p.data = value.to(my_p.dtype if keep else dtype).to(dev)
        if not keep:  # the reference sees what the device holds
            ref_p.data = my_p.data.cpu().to(torch.float64)
    impl.process_weights(mine)
    ref_impl.process_weights(ref)
    x_in = x.to(dev) if not x.dtype.is_floating_point else x.to(dtype).to(dev)
    x_ref = x if not x.dtype.is_floating_point else x.to(dtype).to(torch.float64)
    want = run(ref_impl, ref, x_ref)
    ok, detail = _compare(f'{kind}[{weight_format}]', run(impl, mine, x_in), want, dtype)
    if ok and kind in ('linear', 'lm_head'):
        ok, detail = _check_against_float(ref_impl, ref, x_ref, want, weight_format)
    if ok and kind == 'linear':  # the fused gate|up path of the same layer
        half = want.shape[-1] // 2
        got2 = impl.apply_silu_and_mul(mine, x_in)
        want2 = torch.nn.functional.silu(want[:, :half]) * want[:, half:]
        ok, detail = _compare(f'{kind}[{weight_format}] + silu_and_mul', got2, want2, dtype)
    quant = impl.input_quantization(mine) if kind == 'linear' else None
    if ok and quant is not None:  # its input quantized by the op before it: the same output as from floats
        got3 = impl.apply(mine, ops.quantize_per_token(x_in, quant == 'fp8'))
        same = torch.equal(got3, run(impl, mine, x_in))
        ok, detail = same, (detail if same else f'{kind}[{weight_format}] from a quantized input differs')
    if ok and quant is not None:  # as a gate|up projection before an 8-bit down: the activation's codes
        from .act_quant import steps_apart
        fp8 = quant == 'fp8'
        got4 = impl.apply_silu_and_mul_quant(mine, x_in, fp8)
        want4 = ops.silu_and_mul_quant(impl.apply(mine, x_in), fp8)
        apart = float(steps_apart(got4.q[:got4.rows], want4.q[:want4.rows], fp8).max())
        ok = apart <= 1 and got4.shape == want4.shape and torch.allclose(got4.scale[:got4.rows].cpu(),
                                                                           want4.scale[:want4.rows].cpu(), rtol=1e-2)
        detail = detail if ok else (f'{kind}[{weight_format}] + silu_and_mul_quant: codes up to {apart:g} steps '
                                    'from silu_and_mul_quant of its output, or other scales')
    return ok, detail


def _check_against_float(ref_impl, ref, x, want, weight_format: str) -> Tuple[bool, str]:
    """The reference's linear (float64 input) against a float64 computation of the same map: its weight
    dequantized (``dequantized``, or the dense ``weight``) times its input as the layer quantizes it
    (``fake_quantized_input``: W8A8's per-token activation quantization; the input itself for weight-only
    formats), plus the bias. What holds a format's integer (or fp8) GEMM emulation and scales to its
    definition; the two differ by float64 rounding only."""
    import torch
    w = ref_impl.dequantized(ref, torch.float64) if hasattr(ref_impl, 'dequantized') else ref.weight.double()
    xq = ref_impl.fake_quantized_input(x) if hasattr(ref_impl, 'fake_quantized_input') else x
    bias = getattr(ref, 'bias', None)
    want_f = torch.nn.functional.linear(xq, w, None if bias is None else bias.double())
    err = float((want.double() - want_f).abs().max())
    scale = float(want_f.abs().max()) or 1.0
    ok = err <= 1e-9 * scale
    return ok, (f'{weight_format}: the reference against a float computation of its dequantized weights: max abs '
                f'err {err:.1e} (of outputs up to {scale:.1e})')


def check_names(ops=None) -> List[str]:
    """The checks a device (default: the reference, which has them all) goes through."""

    from lmdeploy.devices.reference import ReferenceOps
    ops = ops if ops is not None else ReferenceOps()
    return [name for name, _ in checks(ops, ops.torch_device(), test_dtype(ops))]


def run_self_tests(device_type: str, ops=None, only=None) -> List[TestResult]:
    """Run the suite on one lmdeploy device type (or on ``ops``, a DeviceOps
    object, when given); ``only``: the names of the checks to run."""
    import torch

    from lmdeploy.devices import get_device
    try:
        ops = ops if ops is not None else get_device(device_type)
        dev = ops.torch_device()
        dtype = test_dtype(ops)
    except Exception as e:
        return [TestResult(device_type, 'setup', False, f'{type(e).__name__}: {e}')]
    results = []
    with torch.inference_mode():
        for name, fn in checks(ops, dev, dtype):
            if only is not None and name not in only:
                continue
            try:
                ok, detail = fn()
                ops.synchronize()
            except Exception as e:
                ok, detail = False, f'{type(e).__name__}: {e}'
                if os.environ.get('LMDEPLOY_CHECK_ENV_TRACEBACK'):
                    traceback.print_exc()
            results.append(TestResult(device_type, name, ok, f'{detail} [{str(dtype).replace("torch.", "")}]'))
    return results
