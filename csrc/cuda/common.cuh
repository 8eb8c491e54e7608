// Shared by lmdeploy's compiled CUDA kernels: element types and the loads a lane makes.
//
// The kernels take raw device pointers and plain integers (the Python side checks shapes and
// dtypes), so this code needs no torch headers: only the CUDA toolkit and, for the bindings,
// pybind11.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

#include "ops.h"

namespace lmdeploy {

// The cache row (codes, or scale and zero) of KV head `head`'s token at `offset` of cache block `block`,
// in the layout the device chose (ops.h CacheRows).
__device__ __forceinline__ int64_t cache_row(const CacheRows& rows, int64_t block, int64_t offset, int64_t head) {
    return block * rows.block + offset * rows.slot + head * rows.head;
}

// Slice `split` of a kv_len-token context (lmdeploy/devices/cuda/splits.py): the tokens [start, end), and
// how many slices the context fills (count). A context is cut into as many of the num_splits slices
// launched as it has min_slice tokens for, each slice a whole number of `tile`-token tiles; the programs of
// slices from count on do nothing, and a context of one slice (or none: kv_len 0) is written to the output
// by its first program, without a merge. The merge works the count out the same way.
struct Slice {
    int start, end, count;
};
__device__ __forceinline__ Slice context_slice(int kv_len, int split, int num_splits, int min_slice, int tile) {
    const int used = max(1, min(num_splits, kv_len / min_slice));
    const int per = ((kv_len + used - 1) / used + tile - 1) / tile * tile;
    const int start = split * per;
    return {start, min(kv_len, start + per), per > 0 ? (kv_len + per - 1) / per : 1};
}
// Slices cut by the decode kernels (a 16-token tile both): what their merge must agree with.
constexpr int kSliceTile = 16;

// Element types by code: the bindings pass one of these for the query / output dtype.
enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Eight 16-bit elements (16 bytes) into floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&out)[8]) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_float(e[i]);
}

// Programmatic dependent launch (sm90+; lmdeploy/devices/cuda/kernels/pdl.py says why): a kernel
// launched by launch_kernel with pdl set may become resident while the kernel before it still runs, so it
// calls this before it reads anything: wait for that kernel's writes, then let the next kernel launch.
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch allowed when pdl is set
// (the caller sets it on sm90+ only; the kernel must start with pdl_wait_then_release()).
template <typename... Params, typename... Args>
inline cudaError_t launch_kernel_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                      cudaStream_t stream, bool pdl, Args&&... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = pdl ? attr : nullptr;
    config.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// The same without dynamic shared memory.
template <typename... Params, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl,
                                 Args&&... args) {
    return launch_kernel_smem(kernel, grid, block, 0, stream, pdl, std::forward<Args>(args)...);
}

__device__ __forceinline__ float warp_max(float x, int width) {
    for (int o = width / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o, width));
    return x;
}

__device__ __forceinline__ float warp_sum(float x, int width) {
    for (int o = width / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o, width);
    return x;
}

// x <- x H, the unnormalised Walsh-Hadamard transform, for `rows` rows of x in shared memory, by the
// whole block (the int4 cache's K is stored in that basis: devices/cache.py); ends synchronised.
template <int D>
__device__ __forceinline__ void hadamard_shared_rows(float (*x)[D], int rows) {
    for (int h = 1; h < D; h *= 2) {
        for (int i = threadIdx.x; i < rows * D / 2; i += blockDim.x) {
            const int row = i / (D / 2), j = i % (D / 2);
            const int i0 = (j / h) * 2 * h + (j % h), i1 = i0 + h;
            const float a = x[row][i0], c = x[row][i1];
            x[row][i0] = a + c;
            x[row][i1] = a - c;
        }
        __syncthreads();
    }
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

template <int N>
using Int = std::integral_constant<int, N>;

// f(T{}, Int<POLICY>{}) for a call's element type (DType code) and KV quant_policy (0, 8 or 4): where
// the kernels' runtime choices become template arguments (f reads them as decltype(x) / x.value).
template <typename F>
void with_type_and_policy(int dtype, int quant_policy, F&& f) {
    auto by_policy = [&](auto t) {
        if (quant_policy == 8) return f(t, Int<8>{});
        if (quant_policy == 4) return f(t, Int<4>{});
        return f(t, Int<0>{});
    };
    if (dtype == static_cast<int>(DType::kBFloat16)) return by_policy(__nv_bfloat16{});
    return by_policy(__half{});
}

}  // namespace lmdeploy
