"""Tensor parallelism on the CPU (gloo): tp > 1 gives tp=1's greedy tokens in
float32, each rank holds only its shard, ranks run as processes ('mp') or
Ray actors, and a lost rank fails requests clearly and leaves no process."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from engine_utils import assert_engine_clean, generate_all, greedy, submit

from lmdeploy.engine.engine import Engine
from lmdeploy.engine.nn.parallel import head_shard, set_tensor_parallel, split_range, tensor_parallel
from lmdeploy.messages import PytorchEngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tp=1, **kw):
    return PytorchEngineConfig(device_type='cpu', dtype='float32', tp=tp, num_gpu_blocks=48, block_size=16, **kw)


def _prompts(seed=None, n=4):
    rng = random.Random(seed)
    return [[rng.randrange(100, 1000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _run(path, prompts, tp=1, new_tokens=10, **kw):
    engine = Engine(path, _config(tp, **kw))
    try:
        out = generate_all(engine, prompts, greedy(new_tokens))
        assert_engine_clean(engine)
        pids = engine.workers.pids() if engine.workers else []
    finally:
        engine.close()
    return out, pids


def _gone(pid, timeout=10.0) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f'/proc/{pid}/stat') as f:
                if f.read().split()[2] in ('Z', 'X'):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- splits
@pytest.mark.parametrize('heads,kv,tp', [(4, 2, 2), (4, 2, 4), (9, 3, 2), (9, 3, 3), (32, 8, 8), (64, 8, 16),
                                         (12, 4, 3), (8, 1, 4)])
def test_head_shards_cover_every_head_once_with_its_kv_head(heads, kv, tp):
    group = heads // kv
    owners = {}
    for rank in range(tp):
        q, kvr = head_shard(heads, kv, rank, tp)
        assert len(q) >= 1 and len(kvr) >= 1
        for h in q:
            assert h not in owners, f'query head {h} on ranks {owners[h]} and {rank}'
            owners[h] = rank
            assert h // group in kvr, f'rank {rank} holds query head {h} but not its KV head {h // group}'
        # a rank's KV heads serve only its own query heads: the local GQA grouping is the global one
        assert len(q) == len(kvr) * group or (kv < tp and len(kvr) == 1)
    assert sorted(owners) == list(range(heads))


@pytest.mark.parametrize('heads,kv,tp', [(4, 2, 3), (4, 4, 8), (6, 2, 8)])
def test_impossible_head_splits_are_refused(heads, kv, tp):
    with pytest.raises(ValueError, match='tp='):
        for rank in range(tp):
            head_shard(heads, kv, rank, tp)


def test_split_range_partitions():
    for n in (1, 7, 128, 1536):
        for size in range(1, 6):
            parts = [split_range(n, r, size) for r in range(size)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


# --------------------------------------------------------------------------- tokens
@pytest.mark.parametrize('name,tp', [('llama', 2), ('qwen2', 2), ('qwen3', 2), ('llama_tied', 4)])
def test_tp_greedy_equals_tp1(name, tp, tiny_model_factory):
    """llama_tied at tp=4: 2 KV heads replicated on 2 ranks each, the tied embedding split like the head."""
    path = tiny_model_factory(name)
    prompts = _prompts()
    want, _ = _run(path, prompts)
    got, pids = _run(path, prompts, tp=tp)
    assert got == want
    assert len(pids) == tp - 1 and all(_gone(p) for p in pids)


def test_smollm2_uneven_splits_equal_tp1(smollm2_path):
    """9 query heads / 3 KV heads: tp=2 splits them 3+6 / 1+2 (uneven)."""
    prompts = _prompts(n=3)
    want, _ = _run(smollm2_path, prompts, new_tokens=8)
    got, _ = _run(smollm2_path, prompts, tp=2, new_tokens=8)
    assert got == want


def test_tp_with_int8_kv_cache(tiny_model_factory):
    path = tiny_model_factory('qwen2')
    prompts = _prompts()
    want, _ = _run(path, prompts, quant_policy=8)
    got, _ = _run(path, prompts, tp=2, quant_policy=8)
    assert got == want


def test_rank_holds_only_its_shard(tiny_model_factory):
    path = tiny_model_factory('llama')
    whole = Engine(path, _config())
    engine = Engine(path, _config(tp=2))
    try:
        full = {n: p.shape for n, p in whole.model.named_parameters()}
        mine = {n: p.shape for n, p in engine.model.named_parameters()}
        cfg = engine.model_config
        d = cfg.head_dim
        assert mine['model.layers.0.self_attn.qkv_proj.weight'][0] == (cfg.num_heads + 2 * cfg.num_kv_heads) * d // 2
        assert mine['model.layers.0.mlp.down_proj.weight'][1] == cfg.intermediate_size // 2
        assert mine['model.embed_tokens.weight'][0] == -(-cfg.vocab_size // 2)
        big = [n for n in full if 'norm' not in n]
        assert sum(mine[n].numel() for n in big) <= 0.51 * sum(full[n].numel() for n in big)
        # its KV cache holds its KV heads only
        assert engine.kv_spec.bytes_per_block * 2 == whole.kv_spec.bytes_per_block
    finally:
        engine.close()
        whole.close()
    assert tensor_parallel().size == 1  # a later tp=1 engine in this process builds whole layers


def test_checkpoint_slice_reads_rows_and_columns(tiny_model_factory):
    from safetensors import safe_open

    from lmdeploy.engine.nn.loading import CheckpointTensor
    from lmdeploy.engine.weights import safetensors_files
    path = safetensors_files(tiny_model_factory('llama'))[0]
    with safe_open(path, framework='pt') as f:
        name = 'model.layers.0.self_attn.q_proj.weight'
        whole = f.get_tensor(name)
        src = CheckpointTensor(f.get_slice(name))
        assert src.shape == tuple(whole.shape)
        assert src.take(range(16, 48)).equal(whole[16:48])
        assert src.take(cols=range(8, 40)).equal(whole[:, 8:40])
        assert src.take().equal(whole)


# --------------------------------------------------------------------------- serving paths
def test_pipeline_tp2_in_an_engine_process(smollm2_path):
    """What `lmdeploy serve api_server --tp 2` runs: the engine process drives the other rank."""
    from lmdeploy import GenerationConfig, pipeline
    pipe = pipeline(smollm2_path, backend_config=PytorchEngineConfig(device_type='cpu', tp=2, engine_process=True,
                                                                       session_len=512, num_gpu_blocks=16))
    try:
        r = pipe('What is the capital of France?', GenerationConfig(max_new_tokens=12, do_sample=False))
    finally:
        pipe.close()
    assert 'Paris' in r.text


def test_cli_flags_reach_the_config():
    from lmdeploy.cli.common import add_engine_args, build_engine_config
    import argparse
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = build_engine_config(p.parse_args(['--tp', '2', '--distributed-executor-backend', 'ray', '--device', 'cpu']))
    assert cfg.tp == 2 and cfg.distributed_executor_backend == 'ray'
    with pytest.raises(ValueError, match='distributed_executor_backend'):
        PytorchEngineConfig(distributed_executor_backend='slurm')


def test_unsplittable_model_is_refused_at_start(tiny_model_factory):
    with pytest.raises(ValueError, match='tp=3'):
        Engine(tiny_model_factory('llama'), _config(tp=3))  # 2 KV heads cannot go over 3 ranks
    assert tensor_parallel().size == 1


# --------------------------------------------------------------------------- failures and shutdown
def test_killed_rank_fails_requests_clearly(tiny_model_factory):
    engine = Engine(tiny_model_factory('qwen2'), _config(tp=2))
    try:
        cols = [submit(engine, [5, 6, 7, 8 + i], greedy(400)) for i in range(3)]
        deadline = time.monotonic() + 60
        while sum(len(c.token_ids) for c in cols) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        (pid, ) = engine.workers.pids()
        os.kill(pid, signal.SIGKILL)
        for c in cols:
            c.wait(30)
            assert c.final.finish_reason == 'error' and 'rank 1' in c.final.error, c.final.error
            assert len(c.token_ids) < 400
        assert not engine.is_alive()
        late = submit(engine, [1, 2, 3], greedy(4)).wait(30)
        assert late.final.finish_reason == 'error' and 'lost a rank' in late.final.error
    finally:
        engine.close()
    assert _gone(pid)


def test_workers_exit_with_their_parent(tiny_model_factory, tmp_path):
    """The engine's process killed outright (no clean-up runs): its workers still exit."""
    script = textwrap.dedent(f'''
        import sys, time
        from lmdeploy.engine.engine import Engine
        from lmdeploy.messages import PytorchEngineConfig
        e = Engine({tiny_model_factory('llama')!r}, PytorchEngineConfig(device_type='cpu', dtype='float32', tp=2,
                   num_gpu_blocks=16, block_size=16))
        print(*e.workers.pids(), flush=True)
        time.sleep(120)
    ''')
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and not _gone(pids[0], 0.2)
    finally:
        proc.kill()
        proc.wait()
    assert _gone(pids[0], 10), 'the worker outlived the engine process'


# --------------------------------------------------------------------------- Ray
@pytest.fixture(scope='module')
def two_node_ray():
    """A Ray cluster of two nodes (two raylets on this machine, one CPU each: as two machines would be)."""
    if os.environ.get('CI') not in ('true', '1'):
        pytest.importorskip('ray')
    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, 'include_dashboard': False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield ray
    ray.shutdown()
    cluster.shutdown()


def test_ray_executor_across_nodes_equals_tp1(two_node_ray, tiny_model_factory):
    ray = two_node_ray
    path = tiny_model_factory('qwen3')
    prompts = _prompts()
    want, _ = _run(path, prompts)
    engine = Engine(path, _config(tp=2, distributed_executor_backend='ray'))
    try:
        placed = ray.util.placement_group_table(engine.workers.launcher.pg)['bundles_to_node_id']
        got = generate_all(engine, prompts, greedy(10))
        assert_engine_clean(engine)
    finally:
        engine.close()
    assert got == want
    # one CPU a node: the two ranks' bundles are on two nodes (which one holds rank 0's is not fixed here:
    # rank 0's bundle asks for this machine's IP, and both nodes have it)
    assert placed[0] != placed[1]
    assert _wait_cpus(ray, 2.0), 'the placement group and the actor were not released'


def test_a_ray_rank_finds_its_device_among_its_nodes(monkeypatch):
    """Ray names a device as its node lists it; a rank that keeps the node's devices in view (tests/test_cuda_tp.py
    runs it on two GPUs) takes the index of that name in the list, or the name itself where nothing is listed."""
    from lmdeploy.engine.parallel.launch import local_device_index
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '2, 3')
    assert local_device_index('3', 'CUDA_VISIBLE_DEVICES') == 1 and local_device_index(2, 'CUDA_VISIBLE_DEVICES') == 0
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES')
    assert local_device_index('1', 'CUDA_VISIBLE_DEVICES') == 1 and local_device_index('0', None) == 0


def _wait_cpus(ray, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get('CPU') == n:
            return True
        time.sleep(0.1)
    return False


def test_workers_import_rank0s_lmdeploy_not_the_working_directorys(tmp_path):
    """A worker started from a folder holding another lmdeploy imports rank 0's (another copy's steps would differ
    from rank 0's and leave the ranks waiting on each other's collectives)."""
    import lmdeploy
    from lmdeploy.engine.parallel.launch import worker_argv
    decoy = tmp_path / 'lmdeploy'
    decoy.mkdir()
    (decoy / '__init__.py').write_text('raise ImportError("the decoy lmdeploy was imported")\n')
    argv = worker_argv('import lmdeploy; print(lmdeploy.__file__)')
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert os.path.samefile(out.stdout.strip(), lmdeploy.__file__)
    # the bare command (what the launcher used before) does import the decoy: the test's folder is a real trap
    bare = subprocess.run([sys.executable, '-c', 'import lmdeploy'], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert 'the decoy lmdeploy was imported' in bare.stderr


def test_ranks_with_other_code_or_another_plan_refuse_to_start():
    """Every rank compares its lmdeploy source and step plan with rank 0's at start-up (here rank 0 of 2, the
    other rank's digests given by a stub gather): equal ones start, another source or plan is refused by
    name instead of leaving the ranks waiting on each other's collectives."""
    from types import SimpleNamespace

    import torch

    from lmdeploy.engine.rank import check_ranks_agree, source_digest
    plan = SimpleNamespace(session_len=random.randrange(64, 4096), max_batch_size=8, max_step_tokens=300,
                           max_mixed_tokens=256, dtype=torch.float32, graphs='none', records_mixed_steps=True,
                           block_size=16, kv_spec=SimpleNamespace(quant_policy=0))

    def device_with_peer(edit):
        def all_gather(t):
            other = t.clone()
            edit(other)
            return torch.stack([t, other])
        return SimpleNamespace(runtime=SimpleNamespace(torch_device=lambda: torch.device('cpu')),
                               all_gather=all_gather)

    set_tensor_parallel(0, 2)
    try:
        check_ranks_agree(plan, device_with_peer(lambda t: None))
        with pytest.raises(RuntimeError, match=r'ranks \[1\] have another lmdeploy source'):
            check_ranks_agree(plan, device_with_peer(lambda t: t.__setitem__(0, t[0] + 1)))
        with pytest.raises(RuntimeError, match=r'ranks \[1\] have another step plan'):
            check_ranks_agree(plan, device_with_peer(lambda t: t.__setitem__(1, t[1] - 1)))
    finally:
        set_tensor_parallel(0, 1)
    assert source_digest() == source_digest()


def test_pick_across_shards_takes_the_largest_and_the_lowest_id_on_ties():
    import torch

    from lmdeploy.engine.nn.embedding import pick_across_shards
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    tp, rows, per = 3, 50, 7
    full = torch.randint(-4, 4, (rows, tp * per), generator=g).float()  # small integers: many ties
    shards = full.view(rows, tp, per).permute(1, 0, 2)  # [tp, T, per], ranks in vocabulary order
    best = shards.amax(dim=2)
    local = shards.argmax(dim=2)  # first maximum in each shard
    ids = (local + torch.arange(tp)[:, None] * per).float()
    assert torch.equal(pick_across_shards(best, ids), full.argmax(dim=1))


def _lm_head_rank(rank, world, port, seed, out):
    """One rank of test_lm_head_greedy_equals_the_gathered_argmax (spawned)."""
    import torch
    import torch.distributed as dist

    from lmdeploy.devices import get_device
    from lmdeploy.engine.nn.build import building
    from lmdeploy.engine.nn.embedding import LMHead
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world)
    set_tensor_parallel(rank, world)
    vocab, dim, rows = 11, 8, 40  # 11 over 2 ranks: 6 and 5 rows, the last rank's sixth is padding
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-3, 1, (vocab, dim), generator=g).float()  # logits <= 0 mostly: padding's 0 would win
    hidden = torch.randint(0, 3, (rows, dim), generator=g).float()
    with building(get_device('cpu')):
        head = LMHead(vocab, dim)
    head.weight.data.zero_()
    head.weight.data[:len(head.rows)] = weight[head.rows.start:head.rows.stop]
    try:
        full = head(hidden)
        cap = lambda x: torch.tanh(x / 2.0) * 2.0  # noqa: E731 (a soft cap, as Gemma 2's)
        got = [head.greedy(hidden).tolist(), head.greedy(hidden, cap).tolist()]
        if rank == 0:
            want = [full.argmax(dim=1).tolist(), cap(full).argmax(dim=1).tolist()]
            tied = int((full == full.amax(dim=1, keepdim=True)).sum(dim=1).gt(1).sum())
            out.put((got, want, tied, int(full.amax(dim=1).lt(0).sum())))
    finally:
        dist.destroy_process_group()


def test_lm_head_greedy_equals_the_gathered_argmax():
    """Under tp=2 (gloo) each rank picks in its own vocabulary rows and the ranks gather two numbers a row:
    the same ids as an argmax over the gathered logits, with ties (small integer logits), a soft cap, and the
    last rank's padding row (logit 0 where most real logits are negative) never picked."""
    import torch.multiprocessing as mp

    from lmdeploy.engine.parallel.group import free_port
    ctx = mp.get_context('spawn')
    out = ctx.Queue()
    seed = random.randrange(1 << 30)
    port = free_port('127.0.0.1')
    procs = [ctx.Process(target=_lm_head_rank, args=(r, 2, port, seed, out)) for r in range(2)]
    for p in procs:
        p.start()
    got, want, tied_rows, negative_rows = out.get(timeout=120)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == want
    assert tied_rows > 0 and negative_rows > 0  # the draw did make ties, and rows the padding would win


def test_set_tensor_parallel_rejects_bad_rank():
    with pytest.raises(ValueError):
        set_tensor_parallel(2, 2)


def test_server_with_tp2_answers_and_ctrl_c_leaves_no_process(smollm2_path):
    """`lmdeploy serve api_server --tp 2`: the server, its engine process and the other rank; Ctrl-C ends all."""
    httpx = pytest.importorskip('httpx')
    pytest.importorskip('fastapi')
    import psutil

    from lmdeploy.engine.parallel.group import free_port
    port = free_port('127.0.0.1')
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    cmd = [sys.executable, '-m', 'lmdeploy', 'serve', 'api_server', smollm2_path, '--server-name', '127.0.0.1',
           '--server-port', str(port), '--device', 'cpu', '--tp', '2', '--session-len', '512',
           '--cache-max-entry-count', '0.01']
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f'http://127.0.0.1:{port}'
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + '/health', timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, 'the server did not become healthy'
            time.sleep(0.2)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert len(family) >= 2  # the engine process and rank 1 (under it)
        body = {'model': httpx.get(url + '/v1/models').json()['data'][0]['id'], 'max_tokens': 12, 'temperature': 0,
                'messages': [{'role': 'user', 'content': 'What is the capital of France?'}]}
        answer = httpx.post(url + '/v1/chat/completions', json=body, timeout=60).json()
        assert 'Paris' in answer['choices'][0]['message']['content']
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(_gone(p.pid) for p in family), [p.pid for p in family if not _gone(p.pid, 0)]


def test_engine_process_reports_a_lost_rank(tiny_model_factory):
    """Under the server the engine runs in its own process: when it loses a rank, the parent stops
    taking requests (the server's /health then answers 503) and says why."""
    import psutil

    from lmdeploy.engine.process import EngineProcess
    proc = EngineProcess(tiny_model_factory('llama'), _config(tp=2))
    try:
        (worker, ) = psutil.Process(proc.pid).children()
        assert submit(proc, [5, 6, 7], greedy(3)).wait(30).final.finish_reason == 'length'
        worker.kill()
        deadline = time.monotonic() + 10
        while proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not proc.is_alive()
        late = submit(proc, [1, 2, 3], greedy(4)).wait(30)
        assert late.final.finish_reason == 'error' and 'rank 1' in late.final.error, late.final.error
    finally:
        proc.close()
    assert _gone(worker.pid)
