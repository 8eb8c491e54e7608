"""Skinny GEMM for a few rows (batch-1 decode): y = x W^T (+ b).

With M <= 8 rows a linear layer only streams its weight from memory, and
cuBLAS then picks split-K kernels that add a reduction launch per GEMM. One
program here owns BLOCK_N output columns over the whole K (no reduction
pass), reading W in long contiguous rows; x is padded to 16 rows for
``tl.dot``, which costs nothing while the weight read dominates. The gated
MLP's gate/up projection has a variant that applies silu(gate) * up in
registers (each program streams the gate and the up rows of its columns).
"""
import torch
import triton
import triton.language as tl

from . import pdl
from .limits import shared_memory

MAX_ROWS = 8
# shared memory one pipeline stage of these kernels holds: a 64 x 256 weight
# tile and the 16 x 256 input tile, 2-byte elements
_STAGE_BYTES = (64 + 16) * 256 * 2


def pipeline_stages(smem_bytes: int, most: int = 4) -> int:
    """How many weight tiles may be in flight: 4 on Hopper (227 KB), fewer
    where a block gets less shared memory (Volta 96 KB, Turing 64 KB). A
    conservative bound (8 KB spare for Triton's scratch): what Triton really
    allocates is checked per GPU generation by tests/test_cuda_compile.py."""
    return max(1, min(most, (smem_bytes - 8 * 1024) // _STAGE_BYTES))


def _stages(x: torch.Tensor) -> int:
    return pipeline_stages(shared_memory(x.device)) if x.device.type == 'cuda' else 4  # the interpreter ignores it


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # the first weight tile depends on no earlier kernel: start reading it
    # before waiting for the kernel that writes x
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl.wait_then_release(PDL)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                other=0.0)
    acc = tl.dot(x, tl.trans(w))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _skinny_silu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, INTER, K, stride_xm, stride_wn, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    """out = silu(x W_gate^T) * (x W_up^T) for W = cat(W_gate, W_up): each
    program owns BLOCK_N output columns and streams both their gate and up
    rows, so the activation is applied in registers."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < INTER
    m_mask = offs_m < M
    g_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = w_ptr + (offs_n[:, None] + INTER).to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    wmask = n_mask[:, None] & (offs_k < K)[None, :]
    wg = tl.load(g_rows + offs_k[None, :], mask=wmask, other=0.0)
    wu = tl.load(u_rows + offs_k[None, :], mask=wmask, other=0.0)
    pdl.wait_then_release(PDL)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                other=0.0)
    acc_g = tl.dot(x, tl.trans(wg))
    acc_u = tl.dot(x, tl.trans(wu))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        wmask = n_mask[:, None] & k_mask[None, :]
        wg = tl.load(g_rows + offs_k[None, :], mask=wmask, other=0.0)
        wu = tl.load(u_rows + offs_k[None, :], mask=wmask, other=0.0)
        acc_g += tl.dot(x, tl.trans(wg))
        acc_u += tl.dot(x, tl.trans(wu))
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + INTER + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # rounded as the unfused ops round: projection outputs, then silu, then the product
    dt = out_ptr.dtype.element_ty
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], (act * up).to(dt),
             mask=m_mask[:, None] & n_mask[None, :])


def skinny_linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    i = weight.shape[0] // 2
    out = torch.empty((m, i), dtype=x.dtype, device=x.device)
    # 32 gate and 32 up rows a program: the same 64-row weight stream as skinny_linear
    _skinny_silu_kernel[(triton.cdiv(i, 32), )](x, weight, bias if bias is not None else x, out, m, i, k, x.stride(0),
                                                weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                                BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=_stages(x),
                                                **_early(weight))
    return out


def _early(weight: torch.Tensor) -> dict:
    """PDL for a launch that reads ``weight``: its first tile is read before the wait for the kernel ahead,
    which is safe only for a weight no kernel writes at run time: a module parameter (loaded once). Any other
    tensor (one dequantized on the fly, say) may be that kernel's output, so its launch waits as usual."""
    on = pdl.ON and isinstance(weight, torch.nn.Parameter)
    return dict(PDL=on, **(pdl.LAUNCH if on else {}))


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2 and weight.stride(1) == 1
            and x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # measured on an H100 over a model's worth of weights (no L2 reuse): 64
    # columns by 256 a tile is best or within 1% for every Llama-3-8B shape
    _skinny_kernel[(triton.cdiv(n, 64), )](x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0),
                                           weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=16,
                                           BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=_stages(x),
                                           **_early(weight))
    return out
