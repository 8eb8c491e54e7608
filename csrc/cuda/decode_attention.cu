// Paged decode attention (flash-decoding): one new query token per sequence attends to its whole
// cached context. The meaning is DeviceOps.paged_decode_attention's (lmdeploy/devices/interface.py),
// the cache layout and the int8 / int4 quantization devices/cache.py's.
//
// One thread block per (sequence, KV head, context slice) handles the G query heads that share the KV
// head (GQA packed). Each lane owns 8 elements of a head (16-bit and int8: 8 consecutive ones; int4:
// the 4 low and 4 high nibbles of 4 bytes, i.e. elements 4c.. and D/2 + 4c..), so D/8 lanes read one
// token's row and a warp reads 32 / (D/8) tokens at once; each lane group keeps its own online softmax
// over its tokens, kUnroll tokens a step with every load issued before any math. The block merges its
// lane groups in shared memory; with several slices per sequence, each slice writes its normalised
// output and log2-sum-exp2 to a float32 buffer [B, H, slices, D + 1] that a second kernel merges.
// int4 stores K in the Hadamard basis (devices/cache.py): the block rotates q the same way (a fast
// Walsh-Hadamard transform in shared memory) before it starts.
#include <cmath>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "ops.h"

namespace lmdeploy {
namespace {

// Tuning (H100, benchmark/kv_quant_attn.py --impl compiled; LMDEPLOY_NVCC_FLAGS=-D... to try others):
// 4 blocks an SM (128 registers a thread) and 2 tokens a step: int8 30 -> 35 % of the copy ceiling,
// 16-bit 75-81 -> 77-80 %; 8 tokens a step (224 registers) lost 10-20 %.
#ifndef LMDEPLOY_DECODE_UNROLL
#define LMDEPLOY_DECODE_UNROLL 2
#endif
#ifndef LMDEPLOY_DECODE_MIN_BLOCKS
#define LMDEPLOY_DECODE_MIN_BLOCKS 4
#endif
constexpr int kWarps = 4;
constexpr int kUnroll = LMDEPLOY_DECODE_UNROLL;  // tokens a lane group loads before it computes

// What one lane reads of one token's row, before dequantizing.
template <typename T, int POLICY>
struct Raw;
template <typename T>
struct Raw<T, 0> { using type = uint4; };      // 8 x 16-bit
template <typename T>
struct Raw<T, 8> { using type = uint2; };      // 8 x uint8
template <typename T>
struct Raw<T, 4> { using type = uint32_t; };   // 4 bytes = 8 nibbles

// Element index (within the head) of the lane's i-th value.
template <int POLICY, int D>
__device__ __forceinline__ int elem_index(int chunk, int i) {
    if (POLICY == 4) return i < 4 ? 4 * chunk + i : D / 2 + 4 * chunk + (i - 4);
    return 8 * chunk + i;
}

template <typename T, int POLICY, int D>
__device__ __forceinline__ typename Raw<T, POLICY>::type load_raw(const void* cache, int64_t row, int chunk) {
    using R = typename Raw<T, POLICY>::type;
    constexpr int kBytesPerRow = POLICY == 0 ? D * 2 : (POLICY == 8 ? D : D / 2);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(cache) + row * kBytesPerRow;
    return *reinterpret_cast<const R*>(base + chunk * sizeof(R));
}

template <typename T, int POLICY>
__device__ __forceinline__ void dequant(typename Raw<T, POLICY>::type raw, float2 sz, float (&x)[8]) {
    if constexpr (POLICY == 0) {
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
    } else if constexpr (POLICY == 8) {
        const uint8_t* c = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = fmaf(static_cast<float>(c[i]), sz.x, sz.y);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[i] = fmaf(static_cast<float>((raw >> (8 * i)) & 0xFu), sz.x, sz.y);
            x[4 + i] = fmaf(static_cast<float>((raw >> (8 * i + 4)) & 0xFu), sz.x, sz.y);
        }
    }
}

__device__ __forceinline__ float2 load_sz(const __half* sz, int64_t row) {
    __half2 s = reinterpret_cast<const __half2*>(sz)[row];
    return make_float2(__low2float(s), __high2float(s));
}

template <typename T, int POLICY, int D, int G>
__global__ void __launch_bounds__(kWarps * 32, LMDEPLOY_DECODE_MIN_BLOCKS)
decode_kernel(const T* __restrict__ q, const void* __restrict__ kc, const void* __restrict__ vc,
              const __half* __restrict__ ksz, const __half* __restrict__ vsz, float* __restrict__ part,
              T* __restrict__ out, const int32_t* __restrict__ tables, const int64_t* __restrict__ kv_lens,
              const int64_t* __restrict__ order, float scale_log2, int64_t stride_qb, int64_t stride_qh,
              int64_t stride_ob, int64_t stride_oh, int64_t stride_bt, int num_kv_heads, int group,
              int block_size, int num_splits, int min_slice, CacheRows rows) {
    constexpr int kLanes = D / 8;               // lanes that read one token's row
    constexpr int kSlots = 32 / kLanes;         // tokens a warp reads at once
    constexpr int kSub = kWarps * kSlots;       // lane groups in the block, each with its own softmax
    constexpr bool kRotate = POLICY == 4;       // devices/cache.py rotates_k: int4, power-of-two D >= 32
    using R = typename Raw<T, POLICY>::type;

    __shared__ float sq[G][D];
    __shared__ float sm_m[kSub][G];
    __shared__ float sm_l[kSub][G];
    __shared__ float sm_acc[kSub][G][D];

    pdl_wait_then_release();
    const int pid = blockIdx.x;
    const int split = pid % num_splits;
    const int kvh = (pid / num_splits) % num_kv_heads;
    int64_t b = pid / (num_splits * num_kv_heads);
    if (order != nullptr) b = order[b];
    const int kv_len = static_cast<int>(kv_lens[b]);
    const Slice slice = context_slice(kv_len, split, num_splits, min_slice, kSliceTile);
    if (split >= slice.count) return;  // a slice this context does not fill: the merge does not read it
    const int start = slice.start, end = slice.end;

    const int tid = threadIdx.x;
    for (int i = tid; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        sq[g][d] = g < group ? to_float(q[b * stride_qb + (kvh * group + g) * stride_qh + d]) : 0.f;
    }
    __syncthreads();
    if constexpr (kRotate) hadamard_shared_rows<D>(sq, G);  // q H (its 1 / sqrt(D) joins the softmax scale)
    const float qscale = kRotate ? scale_log2 * rsqrtf(static_cast<float>(D)) : scale_log2;

    const int warp = tid / 32, lane = tid % 32;
    const int slot = lane / kLanes, chunk = lane % kLanes;
    const int sub = warp * kSlots + slot;
    float qr[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) qr[g][i] = sq[g][elem_index<POLICY, D>(chunk, i)] * qscale;

    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    }

    const int32_t* table = tables + b * stride_bt;
    // (the trip count is the block's, not the lane's: lanes of a warp exchange partial dots by shuffles)
    for (int base = start; base < end; base += kSub * kUnroll) {
        R kraw[kUnroll], vraw[kUnroll];
        float2 ks[kUnroll], vs[kUnroll];
        bool valid[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {  // every load of the step first
            const int t = base + u * kSub + sub;
            valid[u] = t < end;
            if (valid[u]) {
                const int blk = t / block_size;
                const int64_t row = cache_row(rows, table[blk], t - blk * block_size, kvh);
                kraw[u] = load_raw<T, POLICY, D>(kc, row, chunk);
                vraw[u] = load_raw<T, POLICY, D>(vc, row, chunk);
                if constexpr (POLICY != 0) {
                    ks[u] = load_sz(ksz, row);
                    vs[u] = load_sz(vsz, row);
                }
            }
        }
        float s[kUnroll][G];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float k[8];
            dequant<T, POLICY>(kraw[u], ks[u], k);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot = fmaf(qr[g][i], k[i], dot);
                dot = warp_sum(dot, kLanes);
                s[u][g] = valid[u] ? dot : -INFINITY;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, s[u][g]);
            const float corr = m[g] == -INFINITY ? 0.f : exp2f(m[g] - m_new);
            l[g] *= corr;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
            m[g] = m_new;
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (!valid[u]) continue;
            float v[8];
            dequant<T, POLICY>(vraw[u], vs[u], v);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = exp2f(s[u][g] - m[g]);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, v[i], acc[g][i]);
            }
        }
    }

    // merge the block's lane groups
    if (chunk == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            sm_m[sub][g] = m[g];
            sm_l[sub][g] = l[g];
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float top = -INFINITY;
        for (int j = 0; j < kSub; ++j) top = fmaxf(top, sm_m[j][g]);
        const float f = m[g] == -INFINITY ? 0.f : exp2f(m[g] - top);
#pragma unroll
        for (int i = 0; i < 8; ++i) sm_acc[sub][g][elem_index<POLICY, D>(chunk, i)] = acc[g][i] * f;
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        if (g >= group) continue;
        float top = -INFINITY;
        for (int j = 0; j < kSub; ++j) top = fmaxf(top, sm_m[j][g]);
        float total = 0.f, a = 0.f;
        for (int j = 0; j < kSub; ++j) {
            if (sm_m[j][g] != -INFINITY) total += sm_l[j][g] * exp2f(sm_m[j][g] - top);
            a += sm_acc[j][g][d];
        }
        const float o = total > 0.f ? a / total : 0.f;
        const int h = kvh * group + g;
        if (slice.count == 1) {  // the whole context: no merge
            out[b * stride_ob + h * stride_oh + d] = from_float<T>(o);
        } else {
            const int64_t heads = static_cast<int64_t>(num_kv_heads) * group;
            float* p = part + ((b * heads + h) * num_splits + split) * (D + 1);
            p[d] = o;
            if (d == 0) p[D] = total > 0.f ? top + log2f(total) : -INFINITY;
        }
    }
}

// Merge one head's slices by their log2-sum-exp2: a thread a slice for the weights (warp shuffles for
// their maximum and sum), then each output element sums its slices with the loads unrolled, so the merge
// waits on memory a few times instead of once a slice (batch 1 under a decode graph runs in 32 slices).
// Only the slices the context fills are read (context_slice); a context of one slice is already written.
template <typename T, int D>
__global__ void reduce_kernel(const float* __restrict__ part, T* __restrict__ out,
                              const int64_t* __restrict__ kv_lens, int64_t stride_ob, int64_t stride_oh,
                              int num_heads, int num_splits, int min_slice) {
    static_assert(D >= kMaxDecodeSplits && D % 32 == 0, "one thread a slice");
    constexpr int kWarpsHere = D / 32;
    pdl_wait_then_release();
    const int64_t b = blockIdx.x;
    const int h = blockIdx.y;
    const int count = context_slice(static_cast<int>(kv_lens[b]), 0, num_splits, min_slice, kSliceTile).count;
    if (count == 1) return;
    const float* p = part + (b * num_heads + h) * num_splits * (D + 1);
    __shared__ float weight[kMaxDecodeSplits];
    __shared__ float red[2][kWarpsHere];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const float lse = tid < count ? p[tid * (D + 1) + D] : -INFINITY;
    float top = lse;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if (lane == 0) red[0][warp] = top;
    __syncthreads();
    top = red[0][0];
#pragma unroll
    for (int w = 1; w < kWarpsHere; ++w) top = fmaxf(top, red[0][w]);
    const float wt = lse == -INFINITY ? 0.f : exp2f(lse - top);
    if (tid < kMaxDecodeSplits) weight[tid] = wt;
    float sum = wt;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) red[1][warp] = sum;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsHere; ++w) total += red[1][w];
    total = fmaxf(total, 1e-30f);
    float a = 0.f;
#pragma unroll 8
    for (int s = 0; s < count; ++s) a = fmaf(p[s * (D + 1) + tid], weight[s], a);
    out[b * stride_ob + h * stride_oh + tid] = from_float<T>(a / total);
}

template <typename T, int POLICY, int D, int G>
void launch(const DecodeArgs& a, cudaStream_t stream) {
    const dim3 grid(a.batch * a.num_kv_heads * a.num_splits);
    launch_kernel(
        decode_kernel<T, POLICY, D, G>, grid, dim3(kWarps * 32), stream, a.pdl != 0,
        reinterpret_cast<const T*>(a.q), a.k_cache, a.v_cache, reinterpret_cast<const __half*>(a.k_scale_zero),
        reinterpret_cast<const __half*>(a.v_scale_zero), reinterpret_cast<float*>(a.partial),
        reinterpret_cast<T*>(a.out), reinterpret_cast<const int32_t*>(a.block_tables),
        reinterpret_cast<const int64_t*>(a.kv_lens), reinterpret_cast<const int64_t*>(a.order),
        a.scale * 1.4426950408889634f, a.stride_qb, a.stride_qh, a.stride_ob, a.stride_oh, a.stride_bt,
        a.num_kv_heads, a.num_heads / a.num_kv_heads, a.block_size, a.num_splits, a.min_slice, a.rows);
}

template <typename T>
void merge_slices(const DecodeArgs& a, cudaStream_t stream) {
    const dim3 grid(a.batch, a.num_heads);
    const auto* part = reinterpret_cast<const float*>(a.partial);
    const auto* lens = reinterpret_cast<const int64_t*>(a.kv_lens);
    T* out = reinterpret_cast<T*>(a.out);
    if (a.head_dim == 64)
        launch_kernel(reduce_kernel<T, 64>, grid, dim3(64), stream, a.pdl != 0, part, out, lens, a.stride_ob,
                      a.stride_oh, a.num_heads, a.num_splits, a.min_slice);
    else
        launch_kernel(reduce_kernel<T, 128>, grid, dim3(128), stream, a.pdl != 0, part, out, lens, a.stride_ob,
                      a.stride_oh, a.num_heads, a.num_splits, a.min_slice);
}

template <typename T, int POLICY, int D>
void by_group(const DecodeArgs& a, cudaStream_t stream) {
    const int group = a.num_heads / a.num_kv_heads;
    if (group <= 1) return launch<T, POLICY, D, 1>(a, stream);
    if (group <= 2) return launch<T, POLICY, D, 2>(a, stream);
    if (group <= 4) return launch<T, POLICY, D, 4>(a, stream);
    return launch<T, POLICY, D, 8>(a, stream);
}

}  // namespace

bool decode_attention_supports(int dtype, int quant_policy, int head_dim, int num_heads, int num_kv_heads) {
    const bool types = dtype == static_cast<int>(DType::kFloat16) || dtype == static_cast<int>(DType::kBFloat16);
    const bool policy = quant_policy == 0 || quant_policy == 4 || quant_policy == 8;
    const bool heads = num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 8;
    return types && policy && (head_dim == 64 || head_dim == 128) && heads;
}

void paged_decode_attention(const DecodeArgs& a, cudaStream_t stream) {
    if (!decode_attention_supports(a.dtype, a.quant_policy, a.head_dim, a.num_heads, a.num_kv_heads))
        throw std::invalid_argument("paged_decode_attention: unsupported dtype / quant_policy / head_dim / heads");
    if (a.num_splits < 1 || a.num_splits > kMaxDecodeSplits)
        throw std::invalid_argument("paged_decode_attention: num_splits out of range");
    if (a.min_slice < 1) throw std::invalid_argument("paged_decode_attention: min_slice must be at least 1");
    const bool mma_ok = decode_mma_supports(a.block_size);
    if (a.kernel == kDecodeTensorCores && !mma_ok)
        throw std::invalid_argument("paged_decode_attention: the tensor-core kernel needs sm80+ and a block size "
                                    "that is a multiple of 16");
    if (a.batch == 0) return;
    const bool tensor_cores = a.kernel == kDecodeTensorCores || (a.kernel == kDecodeAuto && mma_ok);
    if (tensor_cores) paged_decode_attention_mma(a, stream);
    with_type_and_policy(a.dtype, a.quant_policy, [&](auto t, auto policy) {
        using T = decltype(t);
        constexpr int kPolicy = decltype(policy)::value;
        if (!tensor_cores) {
            if (a.head_dim == 64)
                by_group<T, kPolicy, 64>(a, stream);
            else
                by_group<T, kPolicy, 128>(a, stream);
        }
        if (a.num_splits > 1) merge_slices<T>(a, stream);
    });
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        throw std::runtime_error(std::string("paged_decode_attention: ") + cudaGetErrorString(err));
}

}  // namespace lmdeploy
