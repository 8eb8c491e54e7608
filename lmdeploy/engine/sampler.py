"""Turn the last-position logits of a batch into next tokens.

Order: logit_bias, a grammar's mask (structured output), user logits
processors, repetition penalty, OpenAI's frequency and presence penalties,
bans (bad words, stop ids before ``min_new_tokens``), then greedy argmax or
temperature, top-k, top-p, min-p and a seeded draw (the bias comes first, as
vLLM applies it, so the penalties act on biased scores). Reported logprobs
are those of the model's own distribution (before any processing).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from lmdeploy.devices.interface import DeviceOps

from .sequence import Sequence
from .transfer import tensor_on, to_device

NEG_INF = float('-inf')


def _banned_ids(seq: Sequence) -> List[int]:
    p = seq.params
    banned = list(p.bad_token_ids)
    if seq.num_generated < p.min_new_tokens:
        banned += p.stop_token_ids
    for words in p.bad_sequences:  # ban a multi-token word's last token after its prefix
        prefix = words[:-1]
        if len(prefix) <= seq.num_tokens and seq.token_ids[seq.num_tokens - len(prefix):] == prefix:
            banned.append(words[-1])
    return banned


class _Staged:
    """The small per-row values of one sampling step (rows, ids, penalties, temperatures, seeds, ...), built on
    the host and sent to the device in two copies, one of int64 and one of float32, instead of a copy (and a
    pinned buffer) each: the step's host time is what limits a batch of processed rows (benchmark/
    sampler_cost.py)."""

    def __init__(self):
        self._flat = {torch.int64: [], torch.float32: []}
        self._where: Dict[str, Tuple[torch.dtype, int, Tuple[int, ...]]] = {}
        self._sent: Dict[torch.dtype, torch.Tensor] = {}

    def add(self, name: str, values: List, dtype: torch.dtype = torch.int64, shape: Tuple[int, ...] = None):
        flat = self._flat[dtype]
        flat.extend([0] * (-len(flat) % 4))  # each part 16-byte aligned, as a tensor of its own (Triton kernels
        self._where[name] = (dtype, len(flat), shape or (len(values), ))  # specialise on their pointers' alignment)
        flat.extend(values)

    def add_rows(self, name: str, rows: List[List[int]]):
        """[len(rows), longest] int64, -1 after each row's ids."""
        width = max(len(r) for r in rows)
        self.add(name, [t for r in rows for t in (r + [-1] * (width - len(r)) if len(r) < width else r)],
                 shape=(len(rows), width))

    def send(self, device):
        self._sent = {dt: tensor_on(flat, device, dt) for dt, flat in self._flat.items() if flat}

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, start, shape = self._where[name]
        n = 1
        for d in shape:
            n *= d
        return self._sent[dtype][start:start + n].view(shape)

    def __contains__(self, name: str) -> bool:
        return name in self._where


def logprob_entries(raw: torch.Tensor, tokens: torch.Tensor, tops: List[int]) -> List[Dict[int, float]]:
    """Per row of raw logits [R, V]: ``{token: logprob}`` of the row's most likely ``tops[r]`` tokens and
    its chosen one (``tokens`` [R], on raw's device)."""
    logp = raw.float().log_softmax(dim=-1)
    k = min(max(tops), logp.shape[-1])
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_vals, top_ids, chosen, ids = top_vals.tolist(), top_ids.tolist(), chosen.tolist(), tokens.tolist()
    out = []
    for r, n in enumerate(tops):
        entry = dict(zip(top_ids[r][:n], top_vals[r][:n]))
        entry[ids[r]] = chosen[r]
        out.append(entry)
    return out


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, seqs: List[Sequence]) -> List[Optional[Dict[int, float]]]:
    out: List[Optional[Dict[int, float]]] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if rows:
        entries = logprob_entries(raw[rows], tokens[rows], [seqs[i].params.logprobs for i in rows])
        for i, entry in zip(rows, entries):
            out[i] = entry
    return out


def score_rows(logits_of: Callable[[int, int], torch.Tensor], targets: torch.Tensor, top: int,
               rows_per_call: int = 1024) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p(targets[r]) under row r's logits [R] and (top > 0) the row's ``top`` most likely tokens [R, top]
    with their logprobs [R, top], on the device (nothing waits for it). ``logits_of(a, b)``: the logits of
    rows a..b-1 ([b - a, V]). Rows go through in slices of ``rows_per_call``, so a long prompt's float32
    log-softmax stays small."""
    chosen, top_ids, top_vals = [], [], []
    top = max(0, top)
    for a in range(0, targets.shape[0], rows_per_call):
        t = targets[a:a + rows_per_call]
        logp = logits_of(a, a + t.shape[0]).float().log_softmax(dim=-1)
        chosen.append(logp.gather(1, t.unsqueeze(1)).squeeze(1))
        vals, ids = logp.topk(min(top, logp.shape[-1]), dim=-1) if top else (logp[:, :0], t[:, None][:, :0])
        top_vals.append(vals)
        top_ids.append(ids)
    return torch.cat(chosen), torch.cat(top_ids), torch.cat(top_vals)


def reports_more_than_ids(seq: Sequence) -> bool:
    """Whether this sequence's outputs need more than the token id (logprobs, logits, hidden states), read
    from this step's tensors on the host.

    What sampling reads of the history on the host (penalties, bad words,
    logits processors) needs no such wait: the engine settles the previous
    step's tokens before it samples the next (engine._step), so the history
    is whole by then."""
    p = seq.params
    return p.logprobs is not None or bool(p.output_logits or p.output_last_hidden_state)


def _history(seq: Sequence, start: int = 0) -> List[int]:
    """The sequence's token ids from ``start``, every one known on the host (see reports_more_than_ids)."""
    ids = seq.token_ids[start:]
    if ids and ids[-1] < 0:
        raise RuntimeError('a penalty read the history while its last token was still on the device')
    return ids


NO_TOKEN = -1  # what the host reads for a row that had nothing to draw from


def sample_tokens(logits: torch.Tensor, seqs: List[Sequence], ops: DeviceOps,
                  grammars=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] on the device whose ops are ``ops`` (the model's dtype) -> (next token per row, what the
    host reads of them), both still on the device (nothing here waits for the device).

    Plain greedy rows (most requests) are an argmax of the raw logits; only
    the other rows are copied out, in float32, and processed (bias, grammar,
    penalties, bans, temperature and filters, a seeded draw), so a few such
    requests in a large batch cost in proportion to their number.

    The host's copy has ``NO_TOKEN`` where a processed row has no finite
    logit left to draw from (NaN or infinite logits, or a grammar that
    allows nothing): an engine fault the engine reports as such. The tokens
    themselves stay valid ids, as the next step may read them before the
    host does. Plain greedy rows are not checked (their argmax is the hot
    path)."""
    # OpenAI-penalised rows first: _process edits them as one slice of its copy, in place
    processed = sorted((i for i, s in enumerate(seqs) if not s.params.plain_greedy),
                       key=lambda i: not seqs[i].params.penalised)
    if not processed:
        tokens = ops.argmax(logits)
        return tokens, tokens
    if processed == list(range(len(seqs))):
        sub = logits.float()
        sub = sub.clone() if sub is logits else sub  # edited in place below; the caller's copy gives logprobs
        rows = None
    else:
        rows = tensor_on(processed, logits.device, torch.int64)
        sub = logits.index_select(0, rows).float()
    picked, drawable = _process(sub, [seqs[i] for i in processed], ops, grammars)
    host = torch.where(drawable, picked, torch.full_like(picked, NO_TOKEN))
    if rows is None:
        return picked, host
    tokens = ops.argmax(logits)
    tokens[rows] = picked
    return tokens, tokens.index_put((rows, ), host)


def _process(logits: torch.Tensor, seqs: List[Sequence], ops: DeviceOps, grammars) -> Tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """The next token of each row of float32 ``logits`` (a copy the caller lets us edit) after every
    request's processing, and whether the row had a finite logit to draw from."""
    device = logits.device
    staged = _Staged()  # every small host value below, sent in two copies
    biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if biased:
        rows, cols, vals = [], [], []
        for i in biased:
            bias = seqs[i].params.logit_bias
            rows.extend([i] * len(bias))
            cols.extend(bias)
            vals.extend(bias.values())
        staged.add('bias_rows', rows)
        staged.add('bias_cols', cols)
        staged.add('bias_vals', vals, torch.float32)
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if constrained:
        staged.add('grammar_rows', constrained)
    repeated = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if repeated:
        staged.add('rep_rows', repeated)
        staged.add_rows('rep_ids', [_history(seqs[i]) for i in repeated])
        staged.add('rep_penalty', [seqs[i].params.repetition_penalty for i in repeated], torch.float32)
    penalised = [i for i, s in enumerate(seqs) if s.params.penalised]
    if penalised:  # over the generated tokens only (OpenAI's definition)
        staged.add('pen_rows', penalised)
        staged.add_rows('pen_ids', [_history(seqs[i], seqs[i].num_prompt_tokens) or [-1] for i in penalised])
        staged.add('frequency', [seqs[i].params.frequency_penalty for i in penalised], torch.float32)
        staged.add('presence', [seqs[i].params.presence_penalty for i in penalised], torch.float32)
    ban_rows, ban_cols = [], []
    for i, s in enumerate(seqs):
        ids = _banned_ids(s)
        ban_rows.extend([i] * len(ids))
        ban_cols.extend(ids)
    if ban_rows:
        staged.add('ban_rows', ban_rows)
        staged.add('ban_cols', ban_cols)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        ps = [seqs[i].params for i in sampled]
        staged.add('sample_rows', sampled)
        staged.add('temperature', [p.temperature for p in ps], torch.float32)
        # a filter nobody uses is not run at all
        if any(p.top_k > 0 for p in ps):
            staged.add('top_k', [p.top_k for p in ps])
        if any(p.top_p < 1.0 for p in ps):
            staged.add('top_p', [p.top_p for p in ps], torch.float32)
        if any(p.min_p > 0.0 for p in ps):
            staged.add('min_p', [p.min_p for p in ps], torch.float32)
        staged.add('seeds', [p.seed for p in ps])
        staged.add('offsets', [seqs[i].num_generated for i in sampled])
    staged.send(device)

    if biased:
        logits.index_put_((staged['bias_rows'], staged['bias_cols']), staged['bias_vals'], accumulate=True)
    if constrained:  # structured output: only what the grammar allows next
        rows = staged['grammar_rows']
        mask = to_device(grammars.bitmask([seqs[i].matcher for i in constrained]), device)
        logits[rows] = ops.apply_token_bitmask(logits[rows], mask)
    for i, seq in enumerate(seqs):
        if seq.params.logits_processors:
            generated = tensor_on(_history(seq, seq.num_prompt_tokens), device, torch.int64)
            for proc in seq.params.logits_processors:
                logits[i] = proc(generated, logits[i])
    if repeated:
        rows = staged['rep_rows']
        logits[rows] = ops.apply_repetition_penalty(logits[rows], staged['rep_ids'], staged['rep_penalty'])
    if penalised:
        ids, frequency, presence = staged['pen_ids'], staged['frequency'], staged['presence']
        if penalised == list(range(len(penalised))):  # a leading slice: edited where it is
            part = logits[:len(penalised)]
            out = ops.apply_frequency_presence_penalty(part, ids, frequency, presence)
            if out is not part:
                part.copy_(out)
        else:
            rows = staged['pen_rows']
            logits[rows] = ops.apply_frequency_presence_penalty(logits[rows], ids, frequency, presence)
    if ban_rows:
        logits[staged['ban_rows'], staged['ban_cols']] = NEG_INF

    tokens = ops.argmax(logits)
    # temperature (>= GREEDY_TEMPERATURE) and the filters keep a finite row maximum finite: this row's is the check
    drawable = torch.isfinite(logits.amax(dim=-1))
    if sampled:
        rows = staged['sample_rows']
        sub = ops.apply_temperature(logits[rows], staged['temperature'])
        filters = [staged[f] if f in staged else None for f in ('top_k', 'top_p', 'min_p')]
        sub = ops.top_k_top_p_min_p(sub, *filters, max(seqs[i].params.top_k for i in sampled))
        tokens[rows] = ops.sample(sub, staged['seeds'], staged['offsets'])
    return tokens, drawable
