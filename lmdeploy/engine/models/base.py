"""What every causal LM definition shares: weight loading by HF names."""
from __future__ import annotations

from typing import Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from ..nn import MergedLinear
from ..nn.loading import CheckpointTensor


class CausalLM(nn.Module):
    """Subclasses build ``self.model`` and ``self.lm_head`` and set
    ``stacked_params``: (fused module name, checkpoint name, shard)."""

    stacked_params: List[Tuple[str, str, str]] = []
    ignored_weights: Tuple[str, ...] = ('rotary_emb.inv_freq', )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: a greedy pick is exact on them (every
        bf16/fp16 value is a float32 value), so converting a [batch, vocab]
        tensor is left to the consumers that need float32."""
        return self.finish_logits(self.lm_head(hidden))

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the model does to the LM head's output, elementwise (a soft cap): none here."""
        return logits

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax(compute_logits(hidden)) per row, without making the logits whole under tensor parallelism."""
        return self.lm_head.greedy(hidden, self.finish_logits)

    def _expected_keys(self) -> Set[Tuple[str, str]]:
        keys = set()
        for mod_name, module in self.named_modules():
            prefix = f'{mod_name}.' if mod_name else ''
            for pname, _ in module.named_parameters(recurse=False):
                if isinstance(module, MergedLinear):
                    keys.update((prefix + pname, shard) for shard in module.shard_offsets)
                else:
                    keys.add((prefix + pname, ''))
        if self.tied:
            keys.discard(('lm_head.weight', ''))
        return keys

    def kv_window(self) -> Optional[int]:
        """The most trailing tokens any query attends to, where every attention layer has a sliding window
        (the largest), else None: blocks behind it may be given back (scheduler._slide)."""
        from ..nn import PagedAttention
        windows = [m.variant.get('sliding_window') for m in self.modules() if isinstance(m, PagedAttention)]
        if not windows or None in windows:
            return None
        return max(windows)

    @property
    def tied(self) -> bool:
        return self.config.tie_word_embeddings

    def tie_weights(self):
        """(Re)share the embedding with the LM head; materialising a model
        built on the meta device unshares them."""
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[Tuple[str, CheckpointTensor]]):
        """Copy checkpoint tensors in (each layer takes its rank's part); raise if one is missing or unknown."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: Set[Tuple[str, str]] = set()
        for name, src in weights:
            if isinstance(src, torch.Tensor):
                src = CheckpointTensor(src)
            if any(name.endswith(s) for s in self.ignored_weights):
                continue
            if name == 'lm_head.weight' and self.tied:
                continue
            shard = ''
            for fused, part, shard_name in self.stacked_params:
                if f'.{part}.' in name:
                    name, shard = name.replace(f'.{part}.', f'.{fused}.'), shard_name
                    break
            if name not in params:
                raise ValueError(f'checkpoint tensor {name!r} has no place in {type(self).__name__}')
            mod_name, pname = name.rsplit('.', 1) if '.' in name else ('', name)
            module = self.get_submodule(mod_name)
            if hasattr(module, 'load_param'):
                module.load_param(pname, shard, src)
            else:
                param = params[name]
                if param.shape != src.shape:
                    raise ValueError(f'{name}: checkpoint shape {src.shape} != {tuple(param.shape)}')
                param.data.copy_(src.take())
            loaded.add((name, shard))
        missing = self._expected_keys() - loaded
        if missing:
            names = sorted(f'{n}[{s}]' if s else n for n, s in missing)
            raise ValueError(f'checkpoint lacks {len(missing)} tensors, e.g. {names[:5]}')
