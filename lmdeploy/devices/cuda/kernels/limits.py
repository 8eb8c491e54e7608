"""What one GPU allows a kernel (sizes chosen for Hopper must still compile
on the older GPUs Triton supports), and what must not make Triton compile a
kernel again mid-run."""
import functools
import inspect

import torch
import triton

# opt-in shared memory per block by compute capability (CUDA programming guide)
_SHARED_MEMORY_KIB = {(7, 0): 96, (7, 2): 96, (7, 5): 64, (8, 0): 163, (8, 7): 163, (9, 0): 227}


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int) -> int:
    try:  # what Triton itself checks a kernel against
        return int(triton.runtime.driver.active.utils.get_device_properties(index)['max_shared_mem'])
    except Exception:
        return shared_memory_of(torch.cuda.get_device_capability(index))


def shared_memory_of(capability) -> int:
    """Bytes of shared memory one block may use on GPUs of compute capability
    ``(major, minor)``, from the programming guide's table."""
    major = capability[0]
    return _SHARED_MEMORY_KIB.get(tuple(capability), 99 if major == 8 else 227 if major >= 9 else 48) * 1024


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may use on ``device``."""
    return _shared_memory(device.index if device.index is not None else torch.cuda.current_device())


def capability(device: torch.device) -> tuple:
    """``device``'s compute capability (major, minor), read once."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def tensor_core_dots(device: torch.device) -> bool:
    return tensor_core_dots_of(capability(device))


def tensor_core_dots_of(capability) -> bool:
    """Whether Triton's ``tl.dot`` runs on tensor cores on GPUs of compute capability ``(major, minor)``: from
    sm80 on. Below (Volta, Turing) Triton 3.9 lowers it to FMA loops (its sm70 and sm75 PTX of a 64 x 64 float16
    dot: 2,048 fma.rn, no mma), where tiles sized for tensor cores only unroll larger."""
    return capability[0] >= 8


def no_respecialising(ints=(), pointers=()) -> dict:
    """``triton.jit`` arguments for a kernel's step-varying arguments: Triton
    compiles a new variant when an int becomes (in)divisible by 16 or a
    pointer's 16-byte alignment changes, a stall of a second or more in the
    middle of serving. Block-table widths and views into a step's packed
    metadata change that way from step to step."""
    accepted = inspect.signature(triton.jit).parameters
    kw = {'do_not_specialize': list(ints), 'do_not_specialize_on_alignment': list(pointers)}
    return {k: v for k, v in kw.items() if k in accepted and v}
