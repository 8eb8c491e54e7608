// DeviceOps.rotary_fill_kv: rotary embedding of a step's q and k, and k / v written into their paged
// cache slots (quantized there for a quantized cache), in one pass over q, k and v.
//
// One warp per (token, head) (the query heads, then the KV heads), a few warps a block. A lane holds the
// rotary pairs (x[p], x[p + D/2]) for p = lane + 32 r: the pair that rotate_half mixes is also the
// pair that int4 packs into one byte (element j low, j + D/2 high), so neither needs a shuffle. The
// int4 cache stores K in the Hadamard basis (devices/cache.py): a Walsh-Hadamard transform over the
// warp (shuffles for the index bits below 32, registers above). Quantization follows
// devices/cache.py's quantize(): float16 scale and zero from the row's min and max, codes rounded
// half to even; K less the layer's mean key first where the cache centres K (int4).
#include "common.cuh"
#include "ops.h"

namespace lmdeploy {
namespace {

constexpr int kRotaryWarps = 4;

template <int R>
__device__ __forceinline__ void hadamard_rows(float (&a)[R], float (&b)[R], int lane, int head_dim) {
    // index of a[r]: lane + 32 r; of b[r]: that + D/2. Butterfly y_e = x_e + x_{e^s} (bit s of e clear),
    // x_{e^s} - x_e (set), for every bit s.
#pragma unroll
    for (int s = 1; s < 32; s *= 2) {
        const bool upper = lane & s;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float pa = __shfl_xor_sync(0xffffffffu, a[r], s);
            float pb = __shfl_xor_sync(0xffffffffu, b[r], s);
            a[r] = upper ? pa - a[r] : a[r] + pa;
            b[r] = upper ? pb - b[r] : b[r] + pb;
        }
    }
#pragma unroll
    for (int s = 1; s < R; s *= 2) {  // index bits 32, 64: between a lane's own registers
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r & s) continue;
            float a0 = a[r], a1 = a[r + s], b0 = b[r], b1 = b[r + s];
            a[r] = a0 + a1;
            a[r + s] = a0 - a1;
            b[r] = b0 + b1;
            b[r + s] = b0 - b1;
        }
    }
    const float norm = rsqrtf(static_cast<float>(head_dim));
#pragma unroll
    for (int r = 0; r < R; ++r) {  // the top bit (D/2): a lane's own pair
        float x = a[r], y = b[r];
        a[r] = (x + y) * norm;
        b[r] = (x - y) * norm;
    }
}

// One (token, KV head) row into its slot: as is (16-bit cache) or quantized with its scale and zero.
template <typename T, int R>
__device__ __forceinline__ void store_row(const float (&a)[R], const float (&b)[R], void* cache, void* scale_zero,
                                          int64_t row, int head_dim, int policy, int lane) {
    const int half = head_dim / 2;
    if (policy == 0) {
        T* dst = static_cast<T*>(cache) + row * head_dim;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            dst[lane + 32 * r] = from_float<T>(a[r]);
            dst[lane + 32 * r + half] = from_float<T>(b[r]);
        }
        return;
    }
    float lo = a[0], hi = a[0];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        lo = fminf(lo, fminf(a[r], b[r]));
        hi = fmaxf(hi, fmaxf(a[r], b[r]));
    }
    hi = warp_max(hi, 32);
    lo = -warp_max(-lo, 32);
    const float levels = policy == 8 ? 255.f : 15.f;
    const __half zero_h = __float2half_rn(lo);
    __half scale_h = __float2half_rn((hi - lo) / levels);
    if (!(__half2float(scale_h) > 0.f)) scale_h = __float2half_rn(1.f);
    const float zero = __half2float(zero_h), scale = __half2float(scale_h);
    uint8_t* dst = static_cast<uint8_t*>(cache);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int ca = static_cast<int>(fminf(fmaxf(rintf((a[r] - zero) / scale), 0.f), levels));
        const int cb = static_cast<int>(fminf(fmaxf(rintf((b[r] - zero) / scale), 0.f), levels));
        const int p = lane + 32 * r;
        if (policy == 8) {
            dst[row * head_dim + p] = static_cast<uint8_t>(ca);
            dst[row * head_dim + p + half] = static_cast<uint8_t>(cb);
        } else {
            dst[row * half + p] = static_cast<uint8_t>(ca | (cb << 4));
        }
    }
    if (lane == 0) {
        __half* sz = static_cast<__half*>(scale_zero) + row * 2;
        sz[0] = scale_h;
        sz[1] = zero_h;
    }
}

template <typename T, int R>
__global__ void __launch_bounds__(kRotaryWarps * 32) rotary_fill_kernel(RotaryFillArgs args) {
    pdl_wait_then_release();
    const int t = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int d = args.head_dim, half = d / 2;
    const int heads = args.num_heads + args.num_kv_heads;
    const int64_t slot = static_cast<const int64_t*>(args.slots)[t];
    const float* cos = static_cast<const float*>(args.cos) + t * args.stride_cos;
    const float* sin = static_cast<const float*>(args.sin) + t * args.stride_cos;
    T* out = static_cast<T*>(args.out) + static_cast<int64_t>(t) * heads * d;
    // a warp a head: short blocks, many of them, so the loads of many heads are in flight at once
    const int j = blockIdx.y * kRotaryWarps + threadIdx.x / 32;
    if (j < heads) {
        const bool is_q = j < args.num_heads;
        const int kv = j - args.num_heads;
        const T* x = is_q ? static_cast<const T*>(args.q) + t * args.stride_qt + j * args.stride_qh
                          : static_cast<const T*>(args.k) + t * args.stride_kt + kv * args.stride_kh;
        float a[R], b[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int p = lane + 32 * r;
            const float x1 = to_float(x[p]), x2 = to_float(x[p + half]);
            // rotate_half: x * cos + cat(-x2, x1) * sin, rounded to the model's dtype (as returned)
            const T y1 = from_float<T>(x1 * cos[p] - x2 * sin[p]);
            const T y2 = from_float<T>(x2 * cos[p + half] + x1 * sin[p + half]);
            out[j * d + p] = y1;
            out[j * d + p + half] = y2;
            a[r] = to_float(y1);
            b[r] = to_float(y2);
        }
        if (is_q || slot < 0) return;
        const int64_t blk = slot / args.block_size;
        const int64_t row = cache_row(args.rows, blk, slot - blk * args.block_size, kv);
        if (args.rotate_k) hadamard_rows<R>(a, b, lane, d);
        if (args.k_mean != nullptr) {  // int4's K stored centred (devices/cache.py)
            const float* mean = static_cast<const float*>(args.k_mean) + kv * d;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                a[r] -= mean[lane + 32 * r];
                b[r] -= mean[lane + 32 * r + half];
            }
        }
        store_row<T, R>(a, b, args.k_cache, args.k_scale_zero, row, d, args.quant_policy, lane);
        const T* vx = static_cast<const T*>(args.v) + t * args.stride_vt + kv * args.stride_vh;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            a[r] = to_float(vx[lane + 32 * r]);
            b[r] = to_float(vx[lane + 32 * r + half]);
        }
        store_row<T, R>(a, b, args.v_cache, args.v_scale_zero, row, d, args.quant_policy, lane);
    }
}

template <typename T>
void launch(const RotaryFillArgs& args, cudaStream_t stream) {
    const dim3 grid(args.num_tokens, ceil_div(args.num_heads + args.num_kv_heads, kRotaryWarps));
    const dim3 block(kRotaryWarps * 32);
    switch (args.head_dim) {
        case 64: launch_kernel(rotary_fill_kernel<T, 1>, grid, block, stream, args.pdl != 0, args); break;
        case 128: launch_kernel(rotary_fill_kernel<T, 2>, grid, block, stream, args.pdl != 0, args); break;
        case 256: launch_kernel(rotary_fill_kernel<T, 4>, grid, block, stream, args.pdl != 0, args); break;
    }
}

}  // namespace

bool rotary_fill_supports(int dtype, int quant_policy, int head_dim) {
    return (dtype == 0 || dtype == 1) && (quant_policy == 0 || quant_policy == 8 || quant_policy == 4) &&
           (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

void rotary_fill_kv(const RotaryFillArgs& args, cudaStream_t stream) {
    if (args.num_tokens == 0) return;
    if (args.dtype == static_cast<int>(DType::kFloat16)) {
        launch<__half>(args, stream);
    } else {
        launch<__nv_bfloat16>(args, stream);
    }
}

}  // namespace lmdeploy
