"""Every Triton kernel of the cuda device compiles for each GPU generation
it supports, Volta (sm70) to Hopper (sm90), with the tiles and pipeline
stages its wrapper picks there, and fits that GPU's shared memory per block.

No GPU needed: Triton compiles for a named target with the ptxas it ships.
The kernels compile in worker subprocesses without TRITON_INTERPRET (the
kernel tests turn the interpreter on for this process when there is no GPU).

Compiling is CPU-bound and single-threaded (LLVM, then ptxas: about 9 CPU
minutes for the five targets, over half of it Volta's attention kernels,
whose dots unroll into FMAs): one pool of workers, one per CPU, compiles
every selected target's kernels, costliest first, begun at the lowest
priority when collection is done (tests/background.py), so the CPU the
other tests leave idle does most of it; the tests here run last and wait
for what is left.
"""
import collections
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from background import BACKGROUND_POPEN, Background, lower_priority

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = (70, 75, 80, 86, 90)  # compute capabilities, major * 10 + minor


def shared_memory_of(cap: int) -> int:
    from lmdeploy.devices.cuda.kernels.limits import shared_memory_of
    return shared_memory_of(divmod(cap, 10))


def kernel_specs(cap: int):
    """(kernel, pointer element types, scalar overrides, constexprs, options)
    as the wrappers launch them for a Llama-3-8B-shaped model: head_dim 128,
    32 query and 8 KV heads, hidden 4096, block size 64; and Gemma 2's decode attention."""
    from lmdeploy.devices.cuda.kernels import (activation, argmax, attention, kv_cache, linear, norm, rotary, sample,
                                               w4a16, w8a8_gemm, w8a8_quant)
    from lmdeploy.devices.cuda.kernels.limits import tensor_core_dots_of
    smem = shared_memory_of(cap)
    tensor_cores = tensor_core_dots_of(divmod(cap, 10))  # (Triton's dots: FMA loops below sm80)
    act = 'bf16' if cap >= 80 else 'fp16'  # Volta and Turing run float16 (no bfloat16)
    pdl = cap >= 90
    skinny = dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_K=256, PDL=pdl)
    stages = dict(num_warps=4, num_stages=linear.pipeline_stages(smem))
    decode = dict(NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, BLOCK_SIZE=64, HEAD_DIM=128, BLOCK_D=128, BLOCK_HALF=64, PDL=pdl)

    def kv_ptrs(quant):  # an unquantized cache passes its own tensors where the scales would be
        return ({'kc_ptr': 'u8', 'vc_ptr': 'u8', 'ksz_ptr': 'fp16', 'vsz_ptr': 'fp16'} if quant else {})
    return [
        (norm._rms_norm_kernel, {}, {'eps': 'fp32'}, dict(HAS_RES=True, BLOCK=4096, PDL=pdl),
         dict(num_warps=norm.row_warps(4096, 256))),
        (linear._skinny_kernel, {}, {}, dict(skinny, BLOCK_N=64), stages),
        (linear._skinny_silu_kernel, {}, {}, dict(skinny, BLOCK_N=32), stages),
        (activation._silu_and_mul_kernel, {}, {}, dict(BLOCK=1024, PDL=pdl), dict(num_warps=4)),
        (activation._gelu_tanh_and_mul_kernel, {}, {}, dict(BLOCK=1024, PDL=pdl), dict(num_warps=4)),
        # StarCoder2's and Falcon's LayerNorm and ungated GELU (erf and tanh)
        (norm._layer_norm_kernel, {}, {'eps': 'fp32'}, dict(BLOCK=8192, PDL=pdl), dict(num_warps=8)),
        (activation._gelu_kernel, {}, {}, dict(TANH=False, BLOCK=1024, PDL=pdl), dict(num_warps=4)),
        (activation._gelu_kernel, {}, {}, dict(TANH=True, BLOCK=1024, PDL=pdl), dict(num_warps=4)),
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
        for block_m, block_n, warps, stages, pack in {
            attention.prefill_tiles(128, 100, 4, quant, smem, tensor_cores),
            attention.prefill_tiles(128, 4000, 4, quant, smem, tensor_cores)}
    ] + [  # the small-batch tiles (no order below 16 sequences) and the large-batch ones
        (attention._decode_kernel, dict(kv_ptrs(quant), part_ptr='fp32', tables_ptr='i32', kv_lens_ptr='i64',
                                        order_ptr='i64', q_ptr='fp16' if quant else act),
         {'scale_log2': 'fp32'}, dict(decode, ORDERED=ordered, BLOCK_N=block_n, QUANT=quant, ASM=True),
         dict(num_warps=4, num_stages=stages))
        for quant in (0, 8, 4)
        for ordered, (block_n, stages, _) in ((False, attention.decode_tiles(smem, 1, quant)),
                                              (True, attention.decode_tiles(smem, 256, quant)))
    ] + [  # a sliding window with soft-capped scores (int4: its centred keys' mean back in the scores)
        (kernel, dict(kv_ptrs(quant), tables_ptr='i32', q_start_ptr='i64', q_lens_ptr='i64', kv_lens_ptr='i64',
                      part_ptr='fp32', order_ptr='i64', mean_ptr='fp32', q_ptr='fp16' if quant else act),
         {'scale_log2': 'fp32', 'softcap_log2': 'fp32'}, dict(consts, QUANT=quant, ASM=True, SLIDING=True, SOFTCAP=True,
                                                             CENTRED=quant == 4), options)
        for quant in (0, 4)
        for kernel, consts, options in (
            (attention._prefill_kernel, dict(GROUP=4, BLOCK_SIZE=64, HEAD_DIM=128, BLOCK_D=128, BLOCK_HALF=64,
                                             **dict(zip(('BLOCK_M', 'BLOCK_N'), attention.prefill_tiles(
                                                 128, 4000, 4, quant, smem, tensor_cores))),
                                             PACK=attention.prefill_tiles(128, 4000, 4, quant, smem, tensor_cores)[4]),
             dict(num_warps=4, num_stages=2)),
            (attention._decode_kernel, dict(decode, ORDERED=True, BLOCK_N=attention.decode_tiles(smem, 256, quant)[0]),
             dict(num_warps=4, num_stages=attention.decode_tiles(smem, 256, quant)[1])))
    ] + [  # Gemma 2's heads of 256 (16 query, 8 KV), soft-capped and windowed, with their own tiles
        (attention._decode_kernel, dict(part_ptr='fp32', tables_ptr='i32', kv_lens_ptr='i64', order_ptr='i64',
                                        mean_ptr='fp32'), {'scale_log2': 'fp32', 'softcap_log2': 'fp32'},
         dict(decode, GROUP=2, HEAD_DIM=256, BLOCK_D=256, BLOCK_HALF=128, ORDERED=True, BLOCK_N=block_n, QUANT=0,
              ASM=True, SLIDING=True, SOFTCAP=True), dict(num_warps=warps, num_stages=stages))
        for block_n, stages, warps in [attention.decode_tiles(smem, 256, 0, 256)]
    ] + [
        (attention._decode_reduce_kernel, {'part_ptr': 'fp32', 'kv_lens_ptr': 'i64'}, {},
         dict(HEAD_DIM=head_dim, MAX_SPLITS=attention.MAX_DECODE_SPLITS, BLOCK_D=head_dim, BLOCK_N=64, PDL=pdl,
              SLIDING=True), dict(num_warps=4))
        for head_dim in (128, 256)
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
        (sample._sample_slices_kernel, {'x_ptr': 'fp32', 'seed_ptr': 'i64', 'offset_ptr': 'i64', 'val_ptr': 'fp32',
                                        'idx_ptr': 'i32'}, {}, dict(CHUNK=sample.CHUNK, BLOCK=1024, PDL=pdl),
         dict(num_warps=4)),
    ] + [  # W4A16 (AWQ / GPTQ, group 128), the table's tiles: a decode step's split-K swapped tile into the float32
        # workspace (its nibbles made floats through a constant's mantissa), a batch of 64 rows, a wide layer's
        # 200 rows
        ((w4a16._w4a16_swap_kernel if cfg.swap else w4a16._w4a16_kernel),
         {'qw_ptr': 'i32', 'g_ptr': 'i32', 'out_ptr': 'fp32' if cfg.split > 1 else act}, {},
         dict(GROUP=128, HAS_GIDX=False, HAS_BIAS=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
              BLOCK_K=cfg.block_k, GROUP_M=8, PRECISION='tf32',
              **(dict(DT_MATH=True, MAGIC=0x4300 if act == 'bf16' else 0x6400,
                      MAGIC_BASE=128.0 if act == 'bf16' else 1024.0) if cfg.swap else dict(RESHAPE=True))),
         dict(num_warps=cfg.warps, num_stages=cfg.stages))
        for cfg in (w4a16.choose(1, 4096, 4096, 128, 132), w4a16.choose(64, 4096, 4096, 128, 132),
                    w4a16.choose(200, 28672, 4096, 128, 132))
    ] + [  # the nibbles made 16-bit floats through a constant's mantissa (w4a16_linear's ``magic``)
        (w4a16._w4a16_kernel, {'qw_ptr': 'i32', 'g_ptr': 'i32'}, {},
         dict(GROUP=128, HAS_GIDX=False, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, RESHAPE=True,
              PRECISION='tf32', DT_MATH=True, MAGIC=0x4300 if act == 'bf16' else 0x6400,
              MAGIC_BASE=128.0 if act == 'bf16' else 1024.0), dict(num_warps=4, num_stages=3))
    ] + [  # batch 1's GEMV: K split 32 ways, the last program adding the float32 partial sums up
        (w4a16._w4a16_gemv_kernel, {'qw_ptr': 'i32', 'ws_ptr': 'fp32', 'lock_ptr': 'i32'}, {},
         dict(GROUP=128, HAS_BIAS=False, ROWS=1, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, SPLIT=cfg.split),
         dict(num_warps=cfg.warps, num_stages=cfg.stages))
        for cfg in (w4a16.gemv_choose(1, 4096, 4096, 128, 132), )
    ] + [
        (w4a16._sum_splits_kernel, {'ws_ptr': 'fp32'}, {}, dict(HAS_BIAS=True, BLOCK=1024), dict(num_warps=4)),
        # (more rows: the weight dequantized into a scratch matrix, then cuBLAS)
        (w4a16._dequant_kernel, {'qw_ptr': 'i32', 'g_ptr': 'i32'}, {},
         dict(GROUP=128, HAS_GIDX=False, BLOCK_P=16, BLOCK_N=128), dict(num_warps=4)),

        # W8A8: the per-token quantization (fp8 where e4m3 exists, sm89 on) and the int8 GEMM's epilogue
        (w8a8_quant._epilogue_kernel, {'acc_ptr': 'i32', 'as_ptr': 'fp32', 'ws_ptr': 'fp32'}, {},
         dict(HAS_BIAS=True, BM=32, BN=128, PDL=pdl), dict(num_warps=4)),
    ] + [
        # a row's values (GATED: silu(gate) * up, the op before down) quantized; both paths (a row in one block,
        # or read twice) in each variant
        (w8a8_quant._quant_rows_kernel, {'q_ptr': 'fp8e4nv' if fp8 else 'i8', 's_ptr': 'fp32'}, {},
         dict(QMAX=448.0 if fp8 else 127.0, FP8=fp8, GATED=gated, BLOCK=block, PDL=pdl), dict(num_warps=warps))
        for fp8 in ((False, True) if cap >= 89 else (False, ))
        for gated, (block, warps) in ((False, w8a8_quant._block_and_warps(4096)),
                                      (True, w8a8_quant._block_and_warps(14336)))
    ] + [  # the norm before an 8-bit layer with its quantization: RMSNorm (+ residual)
        (w8a8_quant._rms_norm_quant_kernel, {'q_ptr': 'fp8e4nv' if fp8 else 'i8', 's_ptr': 'fp32'}, {'eps': 'fp32'},
         dict(HAS_RES=True, QMAX=448.0 if fp8 else 127.0, FP8=fp8, BLOCK=8192, PDL=pdl),
         dict(num_warps=norm.row_warps(8192, 256)))
        for fp8 in ((False, True) if cap >= 89 else (False, ))
    ] + [  # int8 W8A8 past FUSED_ROWS rows on sm80 on: one GEMM with the scales fused
        (w8a8_gemm._int8_gemm_kernel,
         ({'a_ptr': f'tensordesc<i8[{bm}, {bk}]>', 'w_ptr': f'tensordesc<i8[{bn}, {bk}]>'} if tma else
          {'a_ptr': 'i8', 'w_ptr': 'i8'}) | {'as_ptr': 'fp32', 'ws_ptr': 'fp32'}, {},
         dict(HAS_BIAS=True, BM=bm, BN=bn, BK=bk, GROUP_M=8, TMA=tma, PDL=pdl),
         dict(num_warps=warps, num_stages=stages))
        for bm, bn, bk, warps, stages in ((w8a8_gemm.choose(4096, 28672, 4096, 132, smem),
                                           w8a8_gemm.choose(512, 4096, 4096, 132, smem),
                                           w8a8_gemm.choose(256, 4096, 14336, 132, smem),
                                           w8a8_gemm.choose(128, 4096, 14336, 132, smem)) if cap >= 80 else ())
        for tma in ((False, True) if cap >= 90 else (False, ))  # (the tiles through TMA descriptors on Hopper)
    ] + [  # int8 gate|up: silu(gate) * up and each row's amax in the GEMM (a decode step's tile too), then the codes
        (w8a8_gemm._gated_gemm_kernel, {'a_ptr': 'i8', 'w_ptr': 'i8', 'as_ptr': 'fp32', 'ws_ptr': 'fp32',
                                        'amax_ptr': 'i32'}, {},
         dict(HAS_BIAS=True, BM=bm, BN=bn, BK=bk, GROUP_M=8, PDL=pdl), dict(num_warps=warps, num_stages=stages))
        for bm, bn, bk, warps, stages in ((w8a8_gemm.choose(256, 28672, 4096, 132, smem),
                                           w8a8_gemm.choose(8, 28672, 4096, 132, smem)) if cap >= 80 else ())
    ] + [
        (w8a8_quant._quant_known_amax_kernel, {'amax_ptr': 'i32', 'q_ptr': 'fp8e4nv' if fp8 else 'i8',
                                               's_ptr': 'fp32'}, {},
         dict(QMAX=448.0 if fp8 else 127.0, FP8=fp8, BLOCK=1024, PDL=pdl), dict(num_warps=4))
        for fp8 in ((False, True) if cap >= 89 else (False, ))
    ], act


def label(fn, constexprs: dict) -> str:
    """A compiled variant's name in the results: the kernel and the constexprs that tell its variants apart
    (the head size where it is not Llama's 128)."""
    return fn.__name__ + ''.join(f' {k}={v}' for k, v in constexprs.items()
                                 if k in ('ORDERED', 'BLOCK_M', 'BLOCK_N', 'BM', 'QUANT', 'PACK', 'SLIDING', 'SOFTCAP',
                                          'TANH', 'FP8', 'GATED', 'MAGIC', 'TMA') or k == 'HEAD_DIM' and v != 128)


def compile_all(cap: int, specs=None, act=None) -> dict:
    """Compile every kernel for sm``cap`` (or those of ``specs``, with activations ``act``): name -> shared
    memory bytes, or the error text."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if specs is None:
        specs, act = kernel_specs(cap)
    results = {}
    for fn, ptrs, scalars, constexprs, options in specs:
        name_of = label(fn, constexprs)
        # a constexpr left out takes its default, and so does an argument defaulting to None that the spec
        # gives no type (what a launch that does not pass them compiles: the kernels without a window or cap)
        constexprs = dict({p.name: p.default for p in fn.params if p.has_default and p.name not in constexprs
                           and (p.is_constexpr or p.default is None and p.name not in ptrs)}, **constexprs)
        sig, aligned = {}, {}
        for i, param in enumerate(fn.params):
            name = param.name
            if name in constexprs:
                sig[name] = 'constexpr'
            elif ptrs.get(name, '').startswith('tensordesc'):  # a TMA descriptor in a pointer's place
                sig[name] = ptrs[name]
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


def _worker_main():
    """A pool worker: reads ``cap index`` lines, compiles that kernel of :func:`kernel_specs` (cap) and
    answers ``result`` and a JSON ``[name, shared bytes or error text]`` on one line."""
    specs = {}
    for line in sys.stdin:
        cap, index = map(int, line.split())
        if cap not in specs:
            specs[cap] = kernel_specs(cap)
        result = compile_all(cap, [specs[cap][0][index]], specs[cap][1])
        print('result', json.dumps(next(iter(result.items()))), flush=True)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class CompilePool:
    """Every kernel of every cap in ``caps``, compiled by worker subprocesses (one per CPU, lowest priority),
    costliest first; ``result()`` is cap -> {name: shared bytes or error text}. A worker that dies
    leaves its kernel's error (its stderr) and is replaced."""

    def __init__(self, caps):
        self.tasks = queue.Queue()
        order = sorted(((cap, i, fn.__name__) for cap in caps for i, (fn, *_) in enumerate(kernel_specs(cap)[0])),
                       key=lambda t: (t[0], 'prefill' not in t[2] and 'rotate' not in t[2]))
        for cap, i, _ in order:  # older GPUs' attention first: the pool's tail is then the short kernels
            self.tasks.put((cap, i))
        self.results = {cap: {} for cap in caps}
        self.env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
        self.env['PYTHONPATH'] = os.pathsep.join([ROOT, os.path.dirname(os.path.abspath(__file__)),
                                                  self.env.get('PYTHONPATH', '')])
        self.procs, self.lock, self.cancelled = [], threading.Lock(), False
        self.threads = [threading.Thread(target=self._serve, daemon=True)
                        for _ in range(max(1, min(_cpus(), self.tasks.qsize())))]
        for t in self.threads:
            t.start()

    def _start(self, background=True):
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), '--worker'], env=self.env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                **(BACKGROUND_POPEN if background else {}))
        if background:
            lower_priority(proc.pid)
        with self.lock:
            self.procs.append(proc)
        tail = collections.deque(maxlen=100)  # stderr drained as it comes, its end kept for a worker that dies
        threading.Thread(target=tail.extend, args=(proc.stderr, ), daemon=True).start()
        return proc, tail

    def _serve(self):
        proc, tail = self._start()
        while not self.cancelled:
            try:
                cap, i = self.tasks.get_nowait()
            except queue.Empty:
                break
            proc.stdin.write(f'{cap} {i}\n')
            proc.stdin.flush()
            line = proc.stdout.readline()
            while line and not line.startswith('result '):  # anything else a compiler printed
                line = proc.stdout.readline()
            if line:
                name, shared = json.loads(line[len('result '):])
            else:  # the worker died (a crash in LLVM or ptxas): this kernel fails, a new worker goes on
                proc.wait()
                time.sleep(0.1)
                spec = kernel_specs(cap)[0][i]
                name = label(spec[0], spec[3])
                shared = f'worker exited with {proc.returncode}: ' + ''.join(tail)[-3000:]
                if self.cancelled:
                    return
                proc, tail = self._start(background=False)
            self.results[cap][name] = shared
        proc.stdin.close()
        proc.wait()

    def result(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self.threads):
            self.cancel()
            pytest.fail(f'compiling the kernels took over {timeout} s')
        return self.results

    def pids(self):
        with self.lock:
            return [proc.pid for proc in self.procs]

    def cancel(self):
        self.cancelled = True
        with self.lock:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()


def _begin(items):
    """The pool for the targets of the selected tests (all of them for a fixture asked outside a run)."""
    if importlib.util.find_spec('triton') is None:
        return None
    return CompilePool(sorted({item.callspec.params['cap'] for item in items}) or TARGETS)


background = Background(
    serves=lambda item: getattr(item, 'originalname', None) == 'test_kernels_compile_and_fit_shared_memory',
    begin=_begin)


@pytest.fixture(scope='module')
def compiled(request):
    """The kernels of every target this session runs the test for, compiled once, by one pool begun in
    the background (tests/background.py)."""
    pytest.importorskip('triton')
    return background.result(request.session)


@pytest.mark.parametrize('cap', TARGETS)
def test_kernels_compile_and_fit_shared_memory(cap, compiled):
    results = compiled[cap]
    # every variant the wrappers launch for this GPU compiled (prefill: the short and long prompts' tiles of
    # each policy, one variant where they are the same: on GPUs with under 96 KB of shared memory)
    expected = {label(fn, constexprs) for fn, _, _, constexprs, _ in kernel_specs(cap)[0]}
    assert set(results) == expected and len(expected) >= (29 if shared_memory_of(cap) >= 96 * 1024 else 26)
    for name, shared in results.items():
        assert isinstance(shared, int), f'{name} does not compile for sm{cap}: {shared}'
        limit = shared_memory_of(cap)
        assert shared <= limit, f'{name} needs {shared} B of shared memory, sm{cap} has {limit // 1024} KiB'


if __name__ == '__main__':
    if sys.argv[1:] == ['--worker']:
        _worker_main()
    else:  # one target's kernels, in this process: python tests/test_cuda_compile.py 90
        print(json.dumps(compile_all(int(sys.argv[1]))))
