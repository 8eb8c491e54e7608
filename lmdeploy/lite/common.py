"""What ``lmdeploy lite``'s weight quantizers (:mod:`.awq`, :mod:`.gptq`) share: the checks on the model and the
group size, loading the float model and running the calibration windows up to its first decoder layer, running
one decoder layer on those inputs (recording what chosen linears read), a progress bar a layer, and writing the
quantized directory (the model's other tensors in its dtype, then :func:`.pack.save_model`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

SUPPORTED_ARCHITECTURES = ('LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM')
LINEARS = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'self_attn.o_proj', 'mlp.gate_proj',
           'mlp.up_proj', 'mlp.down_proj')


class Captured(Exception):
    """Raised by a hook to stop a forward pass once it has what it came for."""


def check_model(model_path: str, tool: str = 'auto_awq') -> dict:
    """config.json of a supported architecture, or ValueError naming it."""
    cfg_path = os.path.join(model_path, 'config.json')
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f'{model_path!r} has no config.json (give a local Hugging Face model directory)')
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get('quantization_config'):
        raise ValueError(f'{model_path} is already quantized ({cfg["quantization_config"].get("quant_method")!r}); '
                         f'{tool} takes a float checkpoint')
    archs = cfg.get('architectures') or [cfg.get('model_type')]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f'{tool}: architecture {arch!r} is not supported; supported: '
                         f'{", ".join(SUPPORTED_ARCHITECTURES)}')
    return cfg


def check_group_size(layer: torch.nn.Module, group: int, prefix: str = '', rows_packed: bool = False):
    """ValueError naming the first linear of ``layer`` whose input size ``group`` does not divide (group -1:
    one group a row, any size), or whose output size is not a multiple of 8 (``rows_packed``: nor its input
    size, GPTQ packing 8 input rows an int32)."""
    for name in LINEARS:
        lin = layer.get_submodule(name)
        if group != -1 and lin.in_features % group:
            raise ValueError(f'{prefix}{name} has {lin.in_features} input features, not a multiple of '
                             f'--w-group-size {group}; choose a group size that divides it (e.g. '
                             f'{_divisor(lin.in_features, group)})')
        if lin.out_features % 8:
            raise ValueError(f'{prefix}{name} has {lin.out_features} output features, not a multiple of 8 '
                             '(8 output columns are packed an int32)')
        if rows_packed and lin.in_features % 8:
            raise ValueError(f'{prefix}{name} has {lin.in_features} input features, not a multiple of 8 '
                             '(GPTQ packs 8 input rows an int32)')


def _divisor(n: int, below: int) -> int:
    for g in (64, 32, 16, 8):
        if g < below and n % g == 0:
            return g
    return n


def resolve_device(device: str) -> torch.device:
    if device in (None, 'auto'):
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError('--device cuda: torch sees no CUDA device here (use --device cpu)')
    return torch.device(device)


def progress(n: int, enabled: bool, desc: str = 'auto_awq'):
    """An iterator over range(n) that shows progress: tqdm's bar where tqdm is installed, else a line a layer
    on stderr."""
    if not enabled:
        return range(n)
    try:
        from tqdm import tqdm
        return tqdm(range(n), desc=desc, unit='layer', file=sys.stderr)
    except ImportError:
        def lines():
            start = time.monotonic()
            for i in range(n):
                yield i
                print(f'{desc}: layer {i + 1}/{n} done ({time.monotonic() - start:.0f} s)', file=sys.stderr,
                      flush=True)
        return lines()


def capture_first_inputs(model, layers, tokens: torch.Tensor, batch_size: int, device):
    """[(hidden_states, kwargs)] per batch of calibration windows, as the first decoder layer receives them."""
    batches = []

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop('hidden_states')
        for key in ('cache', 'past_key_value', 'past_key_values'):
            kwargs.pop(key, None)
        kwargs['use_cache'] = False
        batches.append((hidden, kwargs))
        raise Captured

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for i in range(0, len(tokens), batch_size):
            try:
                model.model(input_ids=tokens[i:i + batch_size].to(device), use_cache=False)
            except Captured:
                pass
    finally:
        handle.remove()
    return batches


def run_layer(layer, batches, hooks: Optional[Dict[str, Callable[[torch.Tensor], None]]] = None,
              outputs: bool = True) -> List[torch.Tensor]:
    """Run ``layer`` on each batch of inputs; ``hooks``: submodule name -> a function given the 2-D input it
    reads, each batch. Without ``outputs``, a hook may raise :class:`Captured` to end a batch early (the
    outputs are then not wanted)."""
    handles = [layer.get_submodule(n).register_forward_pre_hook(
        lambda m, args, fn=fn: fn(args[0].reshape(-1, args[0].shape[-1]))) for n, fn in (hooks or {}).items()]
    outs = []
    try:
        for hidden, kwargs in batches:
            try:
                out = layer(hidden, **kwargs)
            except Captured:
                if outputs:
                    raise
                continue
            if outputs:
                outs.append(out[0] if isinstance(out, tuple) else out)
    finally:
        for h in handles:
            h.remove()
    return outs


class Prepared:
    """A float model loaded for quantizing layer by layer, and its calibration inputs to the first layer."""

    def __init__(self, model: Optional[str], work_dir: str, tool: str, calib_dataset: Optional[str],
                 calib_samples: int, calib_seqlen: int, batch_size: int, w_bits: int, w_group_size: int,
                 device: str, rows_packed: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lmdeploy.default_model import resolve_model_path

        from .calib import calib_tokens
        self.start = time.monotonic()
        self.model_path = resolve_model_path(model)
        self.cfg = check_model(self.model_path, tool)
        # w_bits / w_group_size None: not group-wise 4-bit (smooth_quant's per-channel 8-bit), nothing to check
        if w_bits is not None and w_bits != 4:
            raise ValueError(f'--w-bits {w_bits}: only 4-bit weights are written')
        if w_group_size is not None and w_group_size < 1 and not (rows_packed and w_group_size == -1):
            raise ValueError(f'--w-group-size {w_group_size}: a positive number of input columns'
                             + (' (or -1: one group a row)' if rows_packed else ''))
        if batch_size < 1:
            raise ValueError(f'--batch-size {batch_size}: at least 1')
        if os.path.abspath(work_dir) == os.path.abspath(self.model_path):
            raise ValueError('--work-dir is the model directory itself; choose another')
        self.device = dev = resolve_device(device)
        cfg = self.cfg
        save_dtype = getattr(torch, cfg.get('torch_dtype') or cfg.get('dtype') or 'float16', torch.float16)
        if not isinstance(save_dtype, torch.dtype) or not save_dtype.is_floating_point:
            save_dtype = torch.float16
        self.save_dtype = save_dtype
        # cpu: float32 (bf16 matmuls are slow and coarse there); cuda: the checkpoint's 16-bit dtype
        self.compute_dtype = torch.float32 if dev.type == 'cpu' else (save_dtype if save_dtype != torch.float32
                                                                     else torch.float16)
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.compute_dtype)
        hf.eval()
        self.hf, self.layers = hf, hf.model.layers
        for i, layer in enumerate(self.layers if w_group_size is not None else ()):
            check_group_size(layer, w_group_size, prefix=f'model.layers.{i}.', rows_packed=rows_packed)
        self.tokens = calib_tokens(tokenizer, calib_dataset, calib_samples, calib_seqlen)
        self.calib_tokens = int(self.tokens.numel())  # what the summary reports (smooth_quant --calib-stats: theirs)
        self._key = dict(tool=tool, model=os.path.abspath(self.model_path), calib_dataset=calib_dataset,
                         calib_samples=calib_samples, calib_seqlen=calib_seqlen, batch_size=batch_size,
                         device=dev.type, dtype=str(self.compute_dtype))
        with torch.no_grad():
            hf.model.embed_tokens.to(dev)
            if getattr(hf.model, 'rotary_emb', None) is not None:
                hf.model.rotary_emb.to(dev)
            self.layers[0].to(dev)
            self.batches = capture_first_inputs(hf, self.layers, self.tokens, batch_size, dev)
            hf.model.embed_tokens.to('cpu')

    def key(self) -> dict:
        """What an interrupted run's partial results must match to be resumed (:mod:`.resume`): the tool, the
        model, the calibration and the device's kind and dtype; the tool adds its own arguments."""
        return dict(self._key)

    def save(self, work_dir: str, packed: Dict[str, torch.Tensor], qconfig: dict):
        """The model's tensors but the decoder linears' weights (and a tied lm_head), in the checkpoint's dtype,
        with ``packed`` (the linears' quantized tensors), into ``work_dir`` with ``qconfig``."""
        from .pack import save_model
        tensors = {}
        tied = bool(getattr(self.hf.config, 'tie_word_embeddings', False))
        quantized = {f'model.layers.{i}.{n}.weight' for i in range(len(self.layers)) for n in LINEARS}
        for name, t in self.hf.state_dict().items():
            if name in quantized or (tied and name == 'lm_head.weight'):
                continue
            tensors[name] = t.to('cpu', self.save_dtype) if t.is_floating_point() else t.cpu()
        tensors.update(packed)
        save_model(self.model_path, work_dir, tensors, qconfig)

    def summary(self, group_size: int, **extra) -> dict:
        return {'layers': len(self.layers), 'seconds': time.monotonic() - self.start,
                'calib_tokens': self.calib_tokens, 'group_size': group_size, 'device': str(self.device),
                **extra}
