"""Every Triton kernel of the cuda device compiles for each GPU generation
it supports, Volta (sm70) to Hopper (sm90), with the tiles and pipeline
stages its wrapper picks there, and fits that GPU's shared memory per block.

No GPU needed: Triton compiles for a named target with the ptxas it ships.
Each target compiles in a subprocess without TRITON_INTERPRET (the kernel
tests turn the interpreter on for this process when there is no GPU).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = (70, 75, 80, 86, 90)  # compute capabilities, major * 10 + minor


def shared_memory_of(cap: int) -> int:
    from lmdeploy.devices.cuda.kernels.limits import shared_memory_of
    return shared_memory_of(divmod(cap, 10))


def kernel_specs(cap: int):
    """(kernel, pointer element types, scalar overrides, constexprs, options)
    as the wrappers launch them for a Llama-3-8B-shaped model: head_dim 128,
    32 query and 8 KV heads, hidden 4096, block size 64."""
    from lmdeploy.devices.cuda.kernels import activation, argmax, attention, kv_cache, linear, norm, rotary
    smem = shared_memory_of(cap)
    act = 'bf16' if cap >= 80 else 'fp16'  # Volta and Turing run float16 (no bfloat16)
    pdl = cap >= 90
    skinny = dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_K=256, PDL=pdl)
    stages = dict(num_warps=4, num_stages=linear.pipeline_stages(smem))
    decode = dict(NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, BLOCK_SIZE=64, HEAD_DIM=128, BLOCK_D=128, BLOCK_HALF=64, PDL=pdl)

    def kv_ptrs(quant):  # an unquantized cache passes its own tensors where the scales would be
        return ({'kc_ptr': 'u8', 'vc_ptr': 'u8', 'ksz_ptr': 'fp16', 'vsz_ptr': 'fp16'} if quant else {})
    return [
        (norm._rms_norm_kernel, {}, {'eps': 'fp32'}, dict(HAS_RES=True, BLOCK=4096, PDL=pdl), dict(num_warps=4)),
        (linear._skinny_kernel, {}, {}, dict(skinny, BLOCK_N=64), stages),
        (linear._skinny_silu_kernel, {}, {}, dict(skinny, BLOCK_N=32), stages),
        (activation._silu_and_mul_kernel, {}, {}, dict(BLOCK=1024, PDL=pdl), dict(num_warps=4)),
        (rotary._rotary_kernel, {'cos_ptr': 'fp32', 'sin_ptr': 'fp32'}, {}, dict(HALF=64, BLOCK_H=16, BLOCK_D=64,
                                                                               PDL=pdl), dict(num_warps=2)),
    ] + [  # the cache's writers and readers for each KV policy (uint8 codes, float16 scales when quantized)
        spec for quant in (0, 8, 4) for spec in (
            # int4 takes each layer's mean key (float32) off K; the others pass a tensor of their own, unread
            (kv_cache._fill_kv_kernel,
             dict(kv_ptrs(quant), slot_ptr='i64', kmean_ptr='fp32' if quant == 4 else 'u8' if quant else act), {},
             dict(HALF=64, BLOCK_H=16 if quant == 4 else 8, BLOCK_HALF=64, QUANT=quant, ROTATE=quant == 4,
                  HSCALE=128**-0.5, CENTRE=quant == 4, PDL=pdl), dict(num_warps=2)),
            (kv_cache._rotary_fill_kv_kernel,
             dict(kv_ptrs(quant), cos_ptr='fp32', sin_ptr='fp32', slot_ptr='i64', kmean_ptr='fp32'),
             {}, dict(HEAD_DIM=128, BLOCK_H=16, BLOCK_KV=16 if quant == 4 else 8, BLOCK_HALF=64, QUANT=quant,
                      ROTATE=quant == 4, HSCALE=128**-0.5, CENTRE=quant == 4, PDL=pdl), dict(num_warps=2)))
    ] + [  # prefill attention with the short prompts' tiles and the long ones'
        (attention._prefill_kernel, dict(kv_ptrs(quant), tables_ptr='i32', q_start_ptr='i64', q_lens_ptr='i64',
                                         kv_lens_ptr='i64', q_ptr='fp16' if quant else act),
         {'scale_log2': 'fp32'},
         dict(GROUP=4, BLOCK_SIZE=64, HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=128, BLOCK_HALF=64,
              QUANT=quant, ASM=True, PACK=pack), dict(num_warps=warps, num_stages=stages))
        for quant in (0, 8, 4)
        for block_m, block_n, warps, stages, pack in {attention.prefill_tiles(128, 100, 4, quant, smem),
                                                      attention.prefill_tiles(128, 4000, 4, quant, smem)}
    ] + [  # the small-batch tiles (no order below 16 sequences) and the large-batch ones
        (attention._decode_kernel, dict(kv_ptrs(quant), part_ptr='fp32', tables_ptr='i32', kv_lens_ptr='i64',
                                        order_ptr='i64', q_ptr='fp16' if quant else act),
         {'scale_log2': 'fp32'}, dict(decode, ORDERED=ordered, BLOCK_N=block_n, QUANT=quant, ASM=True),
         dict(num_warps=4, num_stages=stages))
        for quant in (0, 8, 4)
        for ordered, (block_n, stages) in ((False, attention.decode_tiles(smem, 1, quant)),
                                           (True, attention.decode_tiles(smem, 256, quant)))
    ] + [
        (attention._rotate_query_kernel, {'out_ptr': 'fp16'}, {}, dict(HEAD_DIM=128, BLOCK_R=64, HSCALE=128**-0.5),
         dict(num_warps=4)),
        (attention._decode_reduce_kernel, {'part_ptr': 'fp32', 'kv_lens_ptr': 'i64'}, {},
         dict(HEAD_DIM=128, MAX_SPLITS=attention.MAX_DECODE_SPLITS, BLOCK_D=128, BLOCK_N=64, PDL=pdl),
         dict(num_warps=4)),
        (argmax._argmax_slices_kernel, {'x_ptr': 'fp32', 'val_ptr': 'fp32', 'idx_ptr': 'i32'}, {},
         dict(CHUNK=argmax.CHUNK, BLOCK=1024, PDL=pdl), dict(num_warps=4)),
        (argmax._argmax_merge_kernel, {'val_ptr': 'fp32', 'idx_ptr': 'i32', 'out_ptr': 'i64'}, {},
         dict(BLOCK_S=64, PDL=pdl), dict(num_warps=1)),
    ], act


def label(fn, constexprs: dict) -> str:
    """A compiled variant's name in the results: the kernel and the constexprs that tell its variants apart."""
    return fn.__name__ + ''.join(f' {k}={v}' for k, v in constexprs.items()
                                 if k in ('ORDERED', 'BLOCK_M', 'BLOCK_N', 'QUANT', 'PACK'))


def compile_all(cap: int) -> dict:
    """Compile every kernel for sm``cap``: name -> shared memory bytes, or
    the error text."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    specs, act = kernel_specs(cap)
    results = {}
    for fn, ptrs, scalars, constexprs, options in specs:
        name_of = label(fn, constexprs)
        sig, aligned = {}, {}
        for i, param in enumerate(fn.params):
            name = param.name
            if name in constexprs:
                sig[name] = 'constexpr'
            elif name.endswith('_ptr'):
                sig[name] = '*' + ptrs.get(name, act)
                aligned[(i, )] = not getattr(param, 'do_not_specialize_on_alignment', False)
            else:
                sig[name] = scalars.get(name, 'i32')
                aligned[(i, )] = sig[name] == 'i32' and not param.do_not_specialize
        # every argument Triton may specialise as 16-aligned (or a multiple of 16) taken as such: loads then
        # vectorise and the loops pipeline through shared memory, the most a kernel can ask for
        attrs = {key: [['tt.divisibility', 16]] for key, on in aligned.items() if on}
        try:
            kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs=attrs), target=GPUTarget('cuda', cap, 32),
                                    options=options)
            results[name_of] = kernel.metadata.shared
        except Exception as e:  # reported by the test, with the kernel's name
            results[name_of] = f'{type(e).__name__}: {e}'[:2000]
    return results


@pytest.mark.parametrize('cap', TARGETS)
def test_kernels_compile_and_fit_shared_memory(cap):
    pytest.importorskip('triton')
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    run = subprocess.run([sys.executable, os.path.abspath(__file__), str(cap)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    # every variant the wrappers launch for this GPU compiled (prefill: the short and long prompts' tiles of
    # each policy, one variant where they are the same: on GPUs with under 96 KB of shared memory)
    expected = {label(fn, constexprs) for fn, _, _, constexprs, _ in kernel_specs(cap)[0]}
    assert set(results) == expected and len(expected) >= (27 if shared_memory_of(cap) >= 96 * 1024 else 24)
    for name, shared in results.items():
        assert isinstance(shared, int), f'{name} does not compile for sm{cap}: {shared}'
        limit = shared_memory_of(cap)
        assert shared <= limit, f'{name} needs {shared} B of shared memory, sm{cap} has {limit // 1024} KiB'


if __name__ == '__main__':
    print(json.dumps(compile_all(int(sys.argv[1]))))
