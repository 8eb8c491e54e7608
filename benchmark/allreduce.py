"""All-reduce time per message size on this machine's GPUs: NCCL against the one-shot peer-buffer path the cuda
device takes for small messages (lmdeploy/devices/cuda/peer_all_reduce.py), and torch's two-shot op on the same
buffers (each rank sums 1/world of the message and writes it to every rank: the engine does not take it, see
benchmark/RESULTS.md, session 44), each recorded in a CUDA graph of ``--reps`` calls (as a step replays them) and
checked against the exact sum.

    python benchmark/allreduce.py --world 2
"""
from __future__ import annotations

import argparse
import os


def _rank(rank: int, world: int, port: int, sizes, reps: int, dtype_name: str):
    import torch
    import torch.distributed as dist

    from lmdeploy.devices.cuda.peer_all_reduce import PeerAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world,
                            device_id=torch.device('cuda', rank))
    dtype = getattr(torch, dtype_name)
    peer = PeerAllReduce(dist.group.WORLD)
    peer.max_bytes = max(sizes)  # the buffers' size, set on the first call

    def nccl(x):
        dist.all_reduce(x)
        return x

    def two_shots(x):
        op = getattr(torch.ops.symm_mem, 'two_shot_all_reduce_out', None)
        if op is None or not peer._ready:
            return None
        buf = peer._buffers[x.dtype][:x.numel()]
        buf.copy_(x.reshape(-1))
        out = torch.empty_like(x)
        op(buf, 'sum', peer._group, out.view(-1))
        return out

    rows = []
    for size in sizes:
        n = size // torch.empty(0, dtype=dtype).element_size()
        # small integers (the same draw on every rank, scaled by rank + 1): every order of summation gives the
        # exact sum
        gen = torch.Generator(device='cuda').manual_seed(size)
        x = torch.randint(-8, 8, (n, ), device='cuda', generator=gen).to(dtype) * (rank + 1)
        want = x / (rank + 1) * sum(r + 1 for r in range(world))
        row = [size]
        for name, fn in (('nccl', nccl), ('one-shot', peer), ('two-shot', two_shots)):
            got = fn(x.clone())
            if got is None:
                row.append(None)
                continue
            assert torch.equal(got, want), (name, size)
            src = x.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn(src)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn(src)
            graph.replay()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            row.append(start.elapsed_time(end) * 1e3 / (5 * reps))
            del graph
        rows.append(row)
    if rank == 0:
        print(f'{"bytes":>10} {"nccl us":>9} {"one-shot us":>12} {"two-shot us":>12}  ({world} GPUs, {dtype_name}, '
              'in CUDA graphs)')
        for size, *times in rows:
            print(f'{size:>10} {times[0]:9.1f} ' + ' '.join(f'{t:12.1f}' if t is not None else f'{"-":>12}'
                                                          for t in times[1:]))
    dist.destroy_process_group()


def main():
    import torch.multiprocessing as mp
    p = argparse.ArgumentParser()
    p.add_argument('--world', type=int, default=2)
    p.add_argument('--sizes', type=int, nargs='+',
                   default=[8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20,
                            32 << 20])
    p.add_argument('--reps', type=int, default=64)
    p.add_argument('--dtype', default='bfloat16')
    args = p.parse_args()
    from lmdeploy.engine.parallel.group import free_port
    os.environ.setdefault('NCCL_NVLS_ENABLE', '0')
    mp.spawn(_rank, args=(args.world, free_port(), args.sizes, args.reps, args.dtype), nprocs=args.world)


if __name__ == '__main__':
    main()
