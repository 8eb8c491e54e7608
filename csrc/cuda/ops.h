// The compiled kernels' host entry points (what bindings.cpp exposes to Python).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace lmdeploy {

constexpr int kMaxDecodeSplits = 64;  // as the Triton kernel's MAX_DECODE_SPLITS

// Which decode attention kernel runs: auto picks the tensor-core one (decode_attention_mma.cu) where it
// runs (sm80+, block size a multiple of 16), else the CUDA-core one (decode_attention.cu, sm75+).
constexpr int kDecodeAuto = 0, kDecodeCudaCores = 1, kDecodeTensorCores = 2;

// Where a cache row lies (a row: one token's codes of one KV head, W bytes or D elements, or its scale
// and zero): block * block + offset * slot + head * head rows from the start, for the token at offset
// `offset` of cache block `block`. K, V and their scales share these; they are the layout the device
// chose (devices/cache.py): token-major blocks [S, Hkv] (slot Hkv, head 1) or head-major [Hkv, S] (1, S).
struct CacheRows {
    int64_t block, slot, head;
};

// DeviceOps.paged_decode_attention's arguments as raw device pointers and sizes. The Python wrapper
// (lmdeploy/devices/cuda/compiled.py) checks them: q / out [B, H, D] with unit stride in D; caches
// [N, S, Hkv, W] (W = D for 16-bit and int8, D / 2 for int4) and scale/zero [N, S, Hkv, 2] float16,
// laid out as `rows` says; block_tables int32 [B, *]; kv_lens and order int64 [B]; partial float32
// [B, H, num_splits, D + 1] when num_splits > 1. A sequence fills only the slices it has min_slice (>= 1)
// tokens for (common.cuh context_slice; the numbers: lmdeploy/devices/cuda/splits.py).
struct DecodeArgs {
    const void* q;
    const void* k_cache;
    const void* v_cache;
    const void* k_scale_zero;  // nullptr for a 16-bit cache
    const void* v_scale_zero;
    void* partial;
    void* out;
    const void* block_tables;
    const void* kv_lens;
    const void* order;  // nullptr: rows in order
    int dtype;          // DType of q and out (and of a 16-bit cache)
    int quant_policy;   // 0, 8 or 4
    int batch, num_heads, num_kv_heads, head_dim, block_size, num_splits, min_slice;
    CacheRows rows;
    int64_t stride_qb, stride_qh, stride_ob, stride_oh, stride_bt;
    float scale;
    int kernel;  // kDecodeAuto, kDecodeCudaCores or kDecodeTensorCores
    int pdl;     // launch with programmatic dependent launch (sm90+; common.cuh launch_kernel)
};

// DeviceOps.rotary_fill_kv's arguments. q [T, H, D], k / v [T, Hkv, D] with unit stride in D; out
// [T, H + Hkv, D] contiguous (rotated q, then rotated k); cos / sin float32 [T, D] (row stride given);
// slots int64 [T] (negative: not written); caches as DecodeArgs describes them.
struct RotaryFillArgs {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const void* cos;
    const void* sin;
    const void* slots;
    void* k_cache;
    void* v_cache;
    void* k_scale_zero;  // nullptr for a 16-bit cache
    void* v_scale_zero;
    const void* k_mean;  // float32 [Hkv, D]: taken off each key (after rotate_k) before it is quantized, or nullptr
    int dtype, quant_policy, rotate_k;
    int num_tokens, num_heads, num_kv_heads, head_dim, block_size;
    CacheRows rows;
    int64_t stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos;
    int pdl;  // as DecodeArgs::pdl
};

bool rotary_fill_supports(int dtype, int quant_policy, int head_dim);
void rotary_fill_kv(const RotaryFillArgs& args, cudaStream_t stream);

bool decode_attention_supports(int dtype, int quant_policy, int head_dim, int num_heads, int num_kv_heads);
void paged_decode_attention(const DecodeArgs& args, cudaStream_t stream);
bool decode_mma_supports(int block_size);  // on the current device
void paged_decode_attention_mma(const DecodeArgs& args, cudaStream_t stream);  // the main kernel only

}  // namespace lmdeploy
