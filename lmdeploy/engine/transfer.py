"""Host-to-device copies that never wait for the device."""
import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy through pinned memory, queued behind the device's work: a copy
    from pageable memory would first wait for everything queued (the step
    in flight). On the cpu device the tensor is returned as is."""
    if device.type == 'cpu':
        return host
    return host.pin_memory().to(device, non_blocking=True)


def int64_tensor(values) -> torch.Tensor:
    """A host int64 tensor of a list of ints, through numpy: ~4x faster than
    ``torch.tensor`` for the thousands of ints a step packs (0.17 against
    0.68 ms for 8,000)."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))


def tensor_on(values, device: torch.device, dtype=None) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, copied as :func:`to_device` copies."""
    return to_device(torch.tensor(values, dtype=dtype), device)
