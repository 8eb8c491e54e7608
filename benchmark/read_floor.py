"""How fast this GPU reads a buffer of a given size, a kernel launch, its
ramp-up and its tail included: the floor under any kernel that must read
those bytes once (decode attention over a small cache, for one).

torch.sum is one such reader; this also sweeps a plain Triton reader (each
program sums its own chunk of 16-byte words, one word per program written)
over chunk sizes, warps and grids (one program a chunk, or a fixed number
of programs an SM striding over the chunks), and keeps the fastest. Each
call is timed as CUDA graph replays, as the decode benchmarks time theirs.

    python benchmark/read_floor.py --mb 36 71 134 268      # sizes in MB (1e6 bytes)
    python benchmark/read_floor.py --cold                  # each read over another buffer (none in L2)
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl


@triton.jit
def _read_chunks(x_ptr, out_ptr, n_chunks, CHUNK: tl.constexpr, STRIDE: tl.constexpr):
    """Program p sums chunks p, p + grid, ... (STRIDE: the grid strides; else one chunk each)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK, ), tl.int32)
    if STRIDE:
        for c in range(pid, n_chunks, tl.num_programs(0)):
            acc += tl.load(x_ptr + c * CHUNK + offs)
    else:
        acc += tl.load(x_ptr + pid * CHUNK + offs)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def best_read(nbytes: int, verbose: bool = False, copies: int = 1):
    """(us, description) of the fastest reader of ``nbytes`` found here, torch.sum among them; with
    ``copies`` > 1 each read takes the next of that many buffers (so that none is found in L2)."""
    from triton.testing import do_bench_cudagraph
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bufs = [torch.randint(-1000, 1000, (nbytes // 4, ), device='cuda', dtype=torch.int32) for _ in range(copies)]
    words = bufs[0]
    out = torch.empty(1 << 20, device='cuda', dtype=torch.int32)
    scalar = torch.empty((), device='cuda')
    torch.cuda.synchronize()
    results = [(1e3 * do_bench_cudagraph(lambda: [torch.sum(b.view(torch.float32), dim=0, out=scalar) for b in bufs])
                / copies, 'torch.sum')]
    for chunk, warps, per_sm in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16), (0, 2, 4, 8, 16)):
        n_chunks = words.numel() // chunk
        grid = n_chunks if per_sm == 0 else min(n_chunks, per_sm * sms)
        if n_chunks == 0 or grid > out.numel():
            continue

        def run(chunk=chunk, warps=warps, grid=grid, n_chunks=n_chunks, per_sm=per_sm, reads=bufs):
            for b in reads:
                _read_chunks[(grid, )](b, out, n_chunks, CHUNK=chunk, STRIDE=per_sm > 0, num_warps=warps)

        run(reads=[words])  # checked over the first buffer alone: ``out`` holds the last buffer's sums
        got = int(out[:grid].sum())  # the chunks read (the tail past the last whole chunk is left out)
        want = int(words[:n_chunks * chunk].sum())
        assert got == want, (chunk, warps, per_sm, got, want)
        us = 1e3 * do_bench_cudagraph(run) / copies * words.numel() / (n_chunks * chunk)  # the whole buffer
        results.append((us, f'chunk {chunk * 4} B, {warps} warps, ' +
                        (f'{per_sm} programs an SM' if per_sm else 'a program a chunk')))
    results.sort()
    if verbose:
        for us, what in results[:5]:
            print(f'    {us:8.1f} us  {what}')
    return results[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--mb', type=float, nargs='+', default=[36, 71, 134, 268, 537])
    p.add_argument('--ceiling', type=float, default=3.0, help='the copy ceiling in TB/s (an H100 80GB: 3.0)')
    p.add_argument('--cold', action='store_true', help='each read over another of as many buffers as make 0.4 GB '
                   '(none found in L2; by default one buffer is re-read, and one under ~50 MB comes from L2)')
    args = p.parse_args()
    print(f'plain reads on {torch.cuda.get_device_name()}; copy ceiling {args.ceiling} TB/s')
    for mb in args.mb:
        nbytes = int(mb * 1e6) // 4096 * 4096
        us, what = best_read(nbytes, verbose=True, copies=-(-int(0.4e9) // nbytes) if args.cold else 1)
        rate = nbytes / us / 1e6
        print(f'{mb:8.1f} MB: {us:8.1f} us, {rate:.2f} TB/s ({100 * rate / args.ceiling:.0f}% of the ceiling), '
              f'{what}', flush=True)


if __name__ == '__main__':
    main()
