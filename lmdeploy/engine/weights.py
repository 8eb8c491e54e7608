"""Build a model and fill it from safetensors (one file, or shards + index)."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator, List, Tuple

import torch

from lmdeploy.devices.interface import DeviceOps
from lmdeploy.devices.layers import param_layout, weight_format

from .model_config import ModelConfig
from .models import get_model_class
from .nn.build import building
from .nn.feeds import link_quantized_inputs
from .nn.loading import CheckpointTensor
from .nn.parallel import check_splits, tensor_parallel


def safetensors_files(model_path: str) -> List[str]:
    index = os.path.join(model_path, 'model.safetensors.index.json')
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)['weight_map'].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_path, '*.safetensors')))
    if not files:
        raise FileNotFoundError(f'no *.safetensors weights in {model_path!r}')
    return files


def iter_weights(model_path: str, dtype: torch.dtype, device: torch.device) -> Iterator[Tuple[str, CheckpointTensor]]:
    """Every checkpoint tensor, unread: each layer reads only the part its rank holds."""
    from safetensors import safe_open
    for path in safetensors_files(model_path):
        with safe_open(path, framework='pt', device='cpu') as f:
            for name in f.keys():
                yield name, CheckpointTensor(f.get_slice(name), dtype, device)


def load_model(model_path: str, cfg: ModelConfig, dtype: torch.dtype, ops: DeviceOps) -> torch.nn.Module:
    """Construct the model for ``cfg`` for the device ``ops`` in ``dtype`` and load it (this rank's shard under
    tensor parallelism: nn/parallel.py). Its layers call ``ops`` (nn/build.py)."""
    cls = get_model_class(cfg)
    tp = tensor_parallel()
    if tp.size > 1:
        check_splits(cfg.num_heads, cfg.num_kv_heads, tp.size)
    device = ops.torch_device()
    # the checkpoint's weight format picks each layer's implementation on this device (devices/layers.py)
    qc = cfg.raw.get('quantization_config')
    with torch.device('meta'), building(ops, weight_format(qc), qc):
        model = cls(cfg)
    model.tie_weights()
    # the dtype is set while the parameters are still on the meta device: allocated on the device first in the
    # build's float32 and then replaced, a shard takes twice its size at once, and the allocator's split
    # blocks kept the difference: a Llama-3-70B rank at tp=4 (4 x H100) had 12.2 GiB free after loading, 42.8 now
    seen = set()  # (shared, tied, parameters once)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen and not param_layout(module, name).keep_dtype:  # (an int8 weight stays)
                param.data = torch.empty_like(param.data, dtype=dtype)
            seen.add(id(param))
    model.to_empty(device=device)
    model.tie_weights()
    model.load_weights(iter_weights(model_path, dtype, device))
    for module in model.modules():
        if hasattr(module, 'process_weights'):
            module.process_weights()
    link_quantized_inputs(model)  # 8-bit layers' inputs quantized by the op before them (nn/feeds.py)
    return model.eval()
