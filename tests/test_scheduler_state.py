"""The scheduler owns the sequences' cache state: after a step it counts the computed tokens and keys
the full blocks (``postprocess``), and it parks, resumes, finishes and ends sessions; nothing outside
scheduler.py writes its ``idle`` sessions. No engine is started."""
import ast
import pathlib

from lmdeploy.engine.block_manager import BlockManager
from lmdeploy.engine.scheduler import Scheduler
from lmdeploy.engine.sequence import SamplingParams, Sequence, SeqStatus

ROOT = pathlib.Path(__file__).resolve().parent.parent


def make(prefix=True, num_blocks=64):
    too_long = []
    sched = Scheduler(BlockManager(num_blocks, 4, prefix), 8, 64, lambda seq, why: too_long.append(seq))
    return sched, too_long


def seq(sid, ids, **kw):
    return Sequence(sid, sid, ids, SamplingParams(max_new_tokens=100, **kw), lambda out: None, 1000)


def test_postprocess_counts_computed_tokens_keys_full_blocks_and_says_who_samples():
    sched, _ = make()
    a, b = seq(1, list(range(10, 20))), seq(2, list(range(30, 36)))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    starts, done = sched.postprocess(batch)
    assert starts == [0, 10] and done == [(a, 9), (b, 15)]
    assert a.num_computed == 10 and len(a.block_keys) == 2 and len(b.block_keys) == 1
    # a token sampled but still in flight (a placeholder) is computed by the next step, keyed only once known
    a.token_ids += [11, 12, -1]
    a.num_generated = 3
    a.num_computed = 12
    batch = sched.schedule()
    assert dict(zip(batch.seqs, batch.num_new_tokens))[a] == 1
    sched.postprocess(batch)
    assert a.num_computed == 13 and len(a.block_keys) == 3  # tokens 0..11 known: three blocks
    a.token_ids[-1] = 13
    batch = sched.schedule()
    sched.postprocess(batch)
    # the same prompt later: its full blocks come from the prefix cache (the last token is recomputed)
    c = seq(3, list(range(10, 20)))
    sched.add(c)
    sched.schedule()
    assert c.block_ids[:2] == a.block_ids[:2] and c.num_computed == 8
    sched.check_invariants()


def test_samples_of_one_prompt_key_only_the_prompt_blocks_without_prefix_caching():
    sched, _ = make(prefix=False)
    first = seq(1, list(range(10, 19)), share_prompt=True)
    plain = seq(2, list(range(10, 19)))
    sched.add(first)
    sched.add(plain)
    sched.postprocess(sched.schedule())
    assert len(first.block_keys) == 2 and plain.block_keys == []
    second = seq(3, list(range(10, 19)), share_prompt=True)
    sched.add(second)
    sched.schedule()
    assert second.block_ids[:2] == first.block_ids[:2]
    sched.check_invariants()


def test_a_parked_session_keeps_its_blocks_until_it_resumes_or_ends():
    sched, _ = make()
    s = seq(7, list(range(10, 20)))
    sched.add(s)
    sched.postprocess(sched.schedule())
    s.token_ids += [5, -1]  # the second sampled token is still in flight when the turn ends
    s.num_generated = 2
    s.num_computed = 11
    blocks = list(s.block_ids)
    sched.park(s)
    assert s.status == SeqStatus.IDLE and sched.idle == {7: s} and not sched.running
    assert s.token_ids[-1] == 5 and s.num_generated == 1  # the token in flight went with the request
    assert s.block_ids == blocks and s.num_computed == 10  # at most all but the last token stays computed
    assert sched.idle_session(7) is s and sched.idle_session(8) is None
    sched.check_invariants()
    assert sched.resume(7) is s and sched.idle == {} and sched.resume(7) is None
    s.start_turn([40, 41], s.params, s.on_output, 1000)
    sched.add(s)
    batch = sched.schedule()
    assert batch.num_new_tokens == [3]  # only what the cache lacks
    sched.postprocess(batch)
    sched.park(s)
    free = sched.bm.num_free
    sched.end_session(7)
    assert sched.idle == {} and sched.bm.num_free > free and s.block_ids == []
    sched.end_session(7)  # (nothing left: no-op)
    sched.check_invariants()
    assert sched.bm.num_free == sched.bm.num_blocks


def test_finish_frees_the_blocks_and_marks_the_sequence():
    sched, too_long = make(num_blocks=2)
    s = seq(1, list(range(10, 16)))
    big = seq(2, list(range(10, 30)))  # needs 5 blocks of 4: more than the cache has
    sched.add(s)
    sched.add(big)
    sched.postprocess(sched.schedule())
    assert too_long == [big] and big.block_ids == []
    sched.finish(big)  # the scheduler let it go already: only marked
    assert big.status == SeqStatus.FINISHED
    s.token_ids.append(-1)
    s.num_generated = 1
    sched.finish(s)
    assert s.status == SeqStatus.FINISHED and s.block_ids == [] and s.num_tokens == 6 and not sched.running
    sched.check_invariants()
    assert sched.bm.num_free == 2


def _writes_idle(tree) -> list:
    """Lines that write an ``<x>.idle`` mapping: assign / delete an item or the attribute, or call a
    mutating method on it."""
    lines = []
    mutators = {'pop', 'popitem', 'clear', 'update', 'setdefault', '__setitem__', '__delitem__'}

    def is_idle(node):
        return isinstance(node, ast.Attribute) and node.attr == 'idle'

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if is_idle(t) or (isinstance(t, ast.Subscript) and is_idle(t.value)):
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators
                and is_idle(node.func.value)):
            lines.append(node.lineno)
    return lines


def test_only_the_scheduler_writes_its_idle_sessions():
    assert _writes_idle(ast.parse('s.idle[1] = x\ndel s.idle[2]\ns.idle.pop(3)\ns.idle.get(4)\n')) == [1, 2, 3]
    writers = []
    for path in sorted((ROOT / 'lmdeploy').rglob('*.py')):
        if path.name == 'scheduler.py' and path.parent.name == 'engine':
            continue
        writers += [f'{path.relative_to(ROOT)}:{line}' for line in _writes_idle(ast.parse(path.read_text()))]
    assert writers == []
