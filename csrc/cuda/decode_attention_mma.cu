// Paged decode attention on tensor cores (sm80+): the same meaning as decode_attention.cu's kernel
// (DeviceOps.paged_decode_attention; cache layout and quantization as devices/cache.py defines them),
// with both dots as mma.sync m16n8k16 instead of CUDA-core FMAs and warp shuffles, which bound that
// kernel once a quantized cache made the bytes few.
//
// One thread block per (sequence, KV head, context slice); each warp takes 16-token tiles of the slice
// in turn and keeps its own online softmax; the block merges its warps at the end (and a second kernel
// merges slices, decode_attention.cu's reduce). Both products are computed transposed, so that the G
// query heads sharing the KV head are an mma's 8 columns (padded with zero heads) rather than its 16
// rows: the scores as S^T = K Q^T (rows: the tile's 16 tokens), the output as O^T = V^T P^T (rows: head
// elements). Lane (g = lane / 4, t = lane % 4) reads:
//   - for S^T, the K rows of tokens g and g + 8, the D / 4 elements the mma's k slots of quad position
//     t stand for (a dot product does not care which slot holds which element, as long as q's fragment
//     uses the same assignment: elem_of below); it gets the scores of heads 2t and 2t + 1 for those
//     tokens, keeps those two heads' softmax, and transposes P^T's fragment into P's (movmatrix) for:
//   - O^T, the V rows of tokens 2t, 2t + 1, 2t + 8, 2t + 9 (the k slots), the D / 8 head elements of
//     position g (col_of below), two of them (rows g and g + 8) for each m-tile; it gets heads 2t and
//     2t + 1 of those elements, which its own softmax scales.
// A warp copies its tiles into shared memory with cp.async, kStages - 1 tiles ahead of the one it works on
// (whole rows, 16 bytes a lane, so the copy is coalesced; no registers held while the bytes are on their
// way), then each lane reads its 4-16 contiguous bytes a row from there. Rows sit at padded strides in the
// copy so that those reads meet no bank conflicts (Stage below). Rows are found by the cache's strides in
// rows (ops.h CacheRows): over the cuda device's head-major quantized caches a tile's 16 rows are one run
// of bytes; over token-major blocks they are 64-128-byte pieces among the other heads' rows, and DRAM
// served int4's at two thirds of the rate (H100: int4 66 % of the copy ceiling there, 92 % head-major).
//
// A quantized cache enters the dots as its integer codes biased by 1024, exact in float16 (int8: one byte
// permute per two codes puts 0x64 above each byte, the float16 1024 + c; int4: one LOP3 per two codes
// masks two nibbles of a word and ORs 0x64 above them, so a high nibble enters as 1024 + 16 c: those
// k steps sum apart and are scaled by 1/16, those output rows too), with each token's scale and
// zero, and the bias, applied outside them: q.k = scale (q.(1024 + c) - 1024 sum(q)) + zero sum(q), and
// sum_t p_t v_t = sum_t (p_t scale_t) (1024 + c_t) - 1024 sum_t p_t scale_t + sum_t p_t zero_t, the
// last two (with p_t scale_t as the dot rounded it) summed per head apart. q and p go into those dots as
// float16 (for bf16 models too: 11 bits where bf16 has 8); the products are exact and summed in float32,
// so the bias costs about 10 of float32's 24 bits, where the result needs about 11.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <type_traits>

#include "common.cuh"
#include "ops.h"

namespace lmdeploy {
namespace {

// Tuning (H100, benchmark/kv_quant_attn.py --impl compiled, LMDEPLOY_NVCC_FLAGS=-D...): blocks an SM 3 for
// a 16-bit cache (4 would spill), 4 for int8 / int4; 2 / 3 stages for int8 / int4.
// - With the heads as the mmas' rows (before the products were transposed) 3 blocks (168 registers) beat
//   4 (128, spilling 60-116 bytes) by 1.14-1.23x for int8 and up to 1.26x for int4; transposed, 4 blocks
//   were equal to 3 (within 2 %) while contexts were cut into many slices. Since short contexts run
//   unsliced (splits.py), 4 pay for int8 (127 registers instead of 129, no spill; at 64 x 1k one wave of
//   512 blocks instead of 1.3: 1.12x; 1-2 % slower at 8k contexts). 5 blocks (96 registers, 20-44 bytes
//   spilled): 3-15 % slower.
// - Stages: int4 with 2 was within 5 % of 3; 4 gained nothing for either; over token-major blocks int4
//   with 4 or 6 was within 2 % (6: 28 % slower at 64 x 1k); head-major and unsliced, int4 4 or 5 and int8
//   3 within 2 %, int4 6 up to 21 % slower.
#ifndef LMDEPLOY_DECODE_MMA_MIN_BLOCKS
#define LMDEPLOY_DECODE_MMA_MIN_BLOCKS(POLICY) ((POLICY) == 0 ? 3 : 4)
#endif
// Tiles a warp keeps in shared memory (the one it works on and those on their way), by KV policy.
#ifndef LMDEPLOY_DECODE_MMA_STAGES
#define LMDEPLOY_DECODE_MMA_STAGES(POLICY) ((POLICY) == 4 ? 3 : 2)
#endif
// Bytes of its first tiles a warp prefetches into L2 before the wait for the kernel ahead (whole tiles; none
// for a 16-bit cache). H100, back-to-back calls, cold caches (benchmark/kv_quant_attn.py), us at 64 x 1k:
// int4 33.0 with none of this, 32.2 with the lookups alone, then by bytes 4 KB 31.2, 6 KB 30.9, 8 KB 30.6,
// 12 KB 31.0, 16 KB 31.2; int8 54.9, 54.1, then 8 KB 53.8, 12 KB 54.2, 16 KB 55.5, 32 KB 62.0 (the
// prefetched lines evicted before their use); 16-bit (another H100) 102.6, lookups alone 101.8, one tile 103.7.
#ifndef LMDEPLOY_DECODE_MMA_PREFETCH_BYTES
#define LMDEPLOY_DECODE_MMA_PREFETCH_BYTES(POLICY) ((POLICY) == 0 ? 0 : 8192)
#endif
// -DLMDEPLOY_DECODE_TRACE (build.py's $LMDEPLOY_NVCC_FLAGS): each block prints when it reached the steps of its
// work (%globaltimer, ns) for benchmark/decode_trace.py; never in a normal build. printf's buffer holds about
// 4,000 blocks' lines, and printing delays later blocks: trace grids of one wave.
#ifdef LMDEPLOY_DECODE_TRACE
#define TRACE_STAMP(x) \
    uint64_t x;        \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(x))
#else
#define TRACE_STAMP(x)
#endif
constexpr int kWarps = 4;
constexpr int kTile = 16;  // tokens a warp takes at once
constexpr uint32_t kMagic = 0x64646464u;  // float16 1024 in every byte pair's high byte

// ---------------------------------------------------------------- operands
template <typename E>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

// The selected pair of w's bytes (c0, c1) as float16 (1024 + c0, 1024 + c1): the bias is taken off
// outside the dots (see the top).
template <uint32_t SEL>
__device__ __forceinline__ uint32_t codes_to_half2(uint32_t w) {
    return __byte_perm(w, kMagic, SEL);
}

constexpr float kBias = 1024.f;

// Two 4-bit codes of w as float16, one LOP3: MASK 0x000F000F takes the low nibbles of bytes 0 and 2
// (1024 + c), 0x00F000F0 their high nibbles, at four bits up (1024 + 16 c: exact, the mantissa has 10 bits).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t nibbles_to_half2(uint32_t w) {
    uint32_t r;  // (w & MASK) | magic; as C, the compiler spends two instructions (an AND, then an OR)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(w), "n"(MASK), "r"(0x64006400u));
    return r;
}
constexpr uint32_t kLow = 0x000F000Fu, kHigh = 0x00F000F0u;
constexpr float kHighScale = 1.f / 16.f;  // a high nibble's code is 16 c in the dots

// D (16 x 8) += A (16 x 16) B (16 x 8). Lane (g, t) holds A's rows g (a0, a2) and g + 8 (a1, a3) at
// columns (2t, 2t + 1) (a0, a1) and (2t + 8, 2t + 9) (a2, a3); B's column g at rows (2t, 2t + 1) (b0) and
// (2t + 8, 2t + 9) (b1); D's rows g (d0, d1) and g + 8 (d2, d3) at columns 2t, 2t + 1.
template <typename E>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
    if constexpr (std::is_same<E, __half>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// The 8 x 8 matrix of 16-bit pairs a warp holds (lane: row lane / 4, columns 2 (lane % 4) and + 1),
// transposed, in the same layout.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Bytes one lane reads of one K row (for the scores) and of one V row (for the output).
template <int POLICY, int D>
struct Shape {
    static constexpr int kRowBytes = POLICY == 0 ? 2 * D : (POLICY == 8 ? D : D / 2);
    static constexpr int kKBytes = kRowBytes / 4;  // quad position t: a quarter of the row
    static constexpr int kVBytes = kRowBytes / 8;  // position g: an eighth
    static constexpr int kVWords = kVBytes / 4;
};


// One warp's shared-memory copy of one tile: K rows, V rows, then each token's K and V (scale, zero).
// Strides: a K read (quad position t: bytes t kKBytes.. of rows g and g + 8) and a V read (position g:
// bytes g kVBytes.. of rows 2t, 2t + 1, 2t + 8, 2t + 9) hit distinct banks in each phase of a warp's
// access: K rows of 128 bytes or more get 16 bytes of padding (shorter ones are 64 or 32 bytes, whose
// reads of two or four rows fill the 32 banks as they are), V rows always 16.
template <int POLICY, int D>
struct Stage {
    using S = Shape<POLICY, D>;
    static constexpr int kKStride = S::kRowBytes + (S::kRowBytes >= 128 ? 16 : 0);
    static constexpr int kVStride = S::kRowBytes + 16;
    static constexpr int kV = kTile * kKStride;
    static constexpr int kKsz = kV + kTile * kVStride;
    static constexpr int kVsz = kKsz + kTile * 4;
    static constexpr int kBytes = kVsz + kTile * 4;
    static_assert(kBytes % 16 == 0, "stages must stay 16-byte aligned");
};

// Dynamic shared memory of a block: q's rows, then the warps' stages, which the warps' partial outputs
// (rows padded by kOutPad floats against bank conflicts) reuse once every tile is done.
constexpr int kOutPad = 4;
template <int POLICY, int D>
constexpr int smem_bytes() {
    constexpr int stages = LMDEPLOY_DECODE_MMA_STAGES(POLICY) * kWarps * Stage<POLICY, D>::kBytes;
    constexpr int outs = kWarps * 8 * (D + kOutPad) * 4;
    return 8 * D * 4 + (stages > outs ? stages : outs);
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
// The 128-byte piece of global memory holding p into L2 (no register written, nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <int BYTES>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t* w) {
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) {
            const uint4 x = reinterpret_cast<const uint4*>(p)[i];
            w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
        }
    } else if constexpr (BYTES == 8) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        w[0] = x.x, w[1] = x.y;
    } else {
        w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
}

// Head element of quad position t's k slot i (0..3) in k step s: a 16-bit or int8 lane reads elements
// t D/4 .. t D/4 + D/4 - 1 in order; an int4 lane reads bytes t D/8.., whose low nibbles are elements
// t D/8 + j and high ones D/2 + t D/8 + j (devices/cache.py), taken a 4-byte word at a time: low nibbles
// in step 2w, high in 2w + 1, slots (2t, 2t + 1) from bytes 0 and 2 of the word, (2t + 8, 2t + 9) from 1
// and 3 (the pairs one LOP3 decodes).
template <int POLICY, int D>
__device__ __forceinline__ int elem_of(int t, int s, int i) {
    if constexpr (POLICY == 4) return (s % 2) * (D / 2) + t * (D / 8) + 4 * (s / 2) + (i % 2) * 2 + i / 2;
    return t * (D / 4) + 4 * s + i;
}

// Head element of output column n (0..7) of P V's n-tile j: position g reads elements g D/8.. in order
// (int4: bytes g D/16..; m-tile i's row g is byte i's low nibble, row g + 8 its high one: j = 2i, 2i + 1).
template <int POLICY, int D>
__device__ __forceinline__ int col_of(int n, int j) {
    if constexpr (POLICY == 4) return (j % 2) * (D / 2) + n * (D / 16) + j / 2;
    return n * (D / 8) + j;
}

// The B operand of Q K^T for k step s from one token's words: k slots (2t, 2t + 1) and (2t + 8, 2t + 9).
template <int POLICY>
__device__ __forceinline__ void k_operand(const uint32_t* w, int s, uint32_t& b0, uint32_t& b1) {
    if constexpr (POLICY == 0) {
        b0 = w[2 * s], b1 = w[2 * s + 1];
    } else if constexpr (POLICY == 8) {
        b0 = codes_to_half2<0x4140>(w[s]);
        b1 = codes_to_half2<0x4342>(w[s]);
    } else {  // int4: bytes (0, 2) and (1, 3) of word s / 2, low nibbles in even steps, high (16 c) in odd
        const uint32_t x = w[s / 2];
        b0 = s % 2 ? nibbles_to_half2<kHigh>(x) : nibbles_to_half2<kLow>(x);
        b1 = s % 2 ? nibbles_to_half2<kHigh>(x >> 8) : nibbles_to_half2<kLow>(x >> 8);
    }
}

// Element j of position g's part of two tokens' V rows (words a, b), as one operand register (a_j, b_j).
template <int POLICY, int D>
__device__ __forceinline__ uint32_t v_pair(const uint32_t* a, const uint32_t* b, int j) {
    if constexpr (POLICY == 0) {
        return __byte_perm(a[j / 2], b[j / 2], j % 2 ? 0x7632 : 0x5410);
    } else {
        if constexpr (POLICY == 4) {  // byte j / 2 of both: its low nibbles (j even) or high ones (16 c)
            const int byte = j / 2;
            // (a_k, a_k+1, b_k, b_k+1) for the even k at or below byte % 4, moved down a byte for k + 1
            uint32_t xy = __byte_perm(a[byte / 4], b[byte / 4], (byte % 4) < 2 ? 0x5410 : 0x7632);
            if (byte % 2) xy >>= 8;
            return j % 2 ? nibbles_to_half2<kHigh>(xy) : nibbles_to_half2<kLow>(xy);
        }
        const int byte = j;
        // (a_k, b_k, a_k+1, b_k+1) for the even k at or below byte % 4, then the pair holding byte
        const uint32_t xy = __byte_perm(a[byte / 4], b[byte / 4], (byte % 4) < 2 ? 0x5140 : 0x7362);
        return byte % 2 ? codes_to_half2<0x4342>(xy) : codes_to_half2<0x4140>(xy);
    }
}

__device__ __forceinline__ float2 load_sz(const __half* sz, int64_t row) {
    const __half2 s = reinterpret_cast<const __half2*>(sz)[row];
    return make_float2(__low2float(s), __high2float(s));
}

// Over the 8 lanes of one quad position (lanes t, t + 4, ..., t + 28: the rows g of a fragment).
__device__ __forceinline__ float column_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float column_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// 2^x for the online softmax in one MUFU.EX2: -inf gives 0, results under 2^-126 flush to 0 (beside a
// tile maximum's 1, nothing); exp2f spends three more instructions on each for denormal results.
__device__ __forceinline__ float softmax_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------- kernel
template <typename T, int POLICY, int D>
__global__ void __launch_bounds__(kWarps * 32, LMDEPLOY_DECODE_MMA_MIN_BLOCKS(POLICY))
decode_mma_kernel(const DecodeArgs args, float scale_log2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using S = Shape<POLICY, D>;
    using E = typename std::conditional<POLICY == 0, T, __half>::type;  // the dots' operand type
    constexpr int kSteps = D / 16;  // k steps of K Q^T, m-tiles of V^T P^T
    constexpr bool kRotate = POLICY == 4;  // devices/cache.py rotates_k (int4, power-of-two D >= 32)

    constexpr int kStages = LMDEPLOY_DECODE_MMA_STAGES(POLICY);
    constexpr int kPrefetchTiles = LMDEPLOY_DECODE_MMA_PREFETCH_BYTES(POLICY) / (2 * kTile * S::kRowBytes);
    using St = Stage<POLICY, D>;
    extern __shared__ __align__(16) uint8_t smem[];
    float(*sq)[D] = reinterpret_cast<float(*)[D]>(smem);
    uint8_t* stages = smem + 8 * D * 4;
    float(*sm_o)[8][D + kOutPad] = reinterpret_cast<float(*)[8][D + kOutPad]>(stages);  // after the tiles
    __shared__ float sm_m[kWarps][8], sm_l[kWarps][8], sm_z[kWarps][8];

    const T* q = static_cast<const T*>(args.q);
    const uint8_t* kc = static_cast<const uint8_t*>(args.k_cache);
    const uint8_t* vc = static_cast<const uint8_t*>(args.v_cache);
    const __half* ksz = static_cast<const __half*>(args.k_scale_zero);
    const __half* vsz = static_cast<const __half*>(args.v_scale_zero);
    const int64_t* order = static_cast<const int64_t*>(args.order);
    const int num_kv_heads = args.num_kv_heads, num_splits = args.num_splits, block_size = args.block_size;
    const int group = args.num_heads / num_kv_heads;

    TRACE_STAMP(t_entry);
    const int pid = blockIdx.x;
    const int split = pid % num_splits;
    const int kvh = (pid / num_splits) % num_kv_heads;
    int64_t b = pid / (num_splits * num_kv_heads);
    // Before the wait for the kernel ahead (programmatic dependent launch): the lookups and L2 prefetches of
    // the block's q rows and first tiles, which overlap that kernel (or the end of the call ahead), not this
    // block's start. Only what that kernel cannot have written is read into registers here: the order, the
    // lengths and the block tables, written before the step's first kernel (the kernel ahead is the engine's
    // rotary_fill_kv, which writes q and each sequence's newest cache slot). q and the cache are only
    // prefetched into L2, where every SM's writes meet, so a line written meanwhile is read fresh after it.
    if (order != nullptr) b = order[b];
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    if (tid < 2 * group)  // this KV head's query rows: a 128-byte piece from each half of a row (D 64: one twice)
        prefetch_l2(q + b * args.stride_qb + (kvh * group + tid / 2) * args.stride_qh + (tid % 2) * (D / 2));
    const int kv_len = static_cast<int>(static_cast<const int64_t*>(args.kv_lens)[b]);
    static_assert(kTile == kSliceTile, "the merge cuts contexts as this kernel does");
    const Slice slice = context_slice(kv_len, split, num_splits, args.min_slice, kTile);
    if (split >= slice.count) return;  // a slice this context does not fill: the merge does not read it
    const int start = slice.start, end = slice.end;
    TRACE_STAMP(t_len);

    // A lane reads K rows (and K and V scales / zeros) of tokens g and g + 8 of a tile, V rows of tokens 2t,
    // 2t + 1, 2t + 8, 2t + 9; tokens past the slice are copies of its last token (their scores are masked)
    const int32_t* table = static_cast<const int32_t*>(args.block_tables) + b * args.stride_bt;
    // (one division a tile: the tile lies in one block; then a token is a multiple of the slot stride away)
    const bool pow2 = (block_size & (block_size - 1)) == 0;
    const int shift = __ffs(block_size) - 1;
    const CacheRows rows = args.rows;  // (head-major blocks: a tile's rows are one run of bytes)
    auto tile_row0 = [&](int base) {  // the row of the tile's first token (of this KV head)
        const int blk = pow2 ? base >> shift : base / block_size;
        return cache_row(rows, table[blk], base - blk * block_size, kvh);
    };
    // the row of token r of the tile from base, its first token's at row0 (past the slice: its last token's)
    auto token_row = [&](int64_t row0, int base, int r) { return row0 + min(r, end - 1 - base) * rows.slot; };
    // this warp's tiles: first, first + kWarps kTile, ...
    const int first = start + warp * kTile;
    const int num_tiles = first < end ? (end - first + kWarps * kTile - 1) / (kWarps * kTile) : 0;
    auto tile_base = [&](int i) { return first + i * kWarps * kTile; };
    // the warp's first tiles into L2: lane r < 16 the K row of token r, lane 16 + r its V row, and its scale
    // and zero (rows of 32-256 bytes: one 128-byte piece, or two)
#pragma unroll
    for (int i = 0; i < kPrefetchTiles; ++i) {
        if (i < num_tiles) {
            const int base = tile_base(i);
            const int64_t row = token_row(tile_row0(base), base, lane % kTile);
            const uint8_t* src = (lane < kTile ? kc : vc) + row * S::kRowBytes;
#pragma unroll
            for (int off = 0; off < S::kRowBytes; off += 128) prefetch_l2(src + off);
            if constexpr (POLICY != 0) prefetch_l2((lane < kTile ? ksz : vsz) + 2 * row);
        }
    }
    pdl_wait_then_release();
    // q's rows (found in L2 now), asked for before the first tiles' copies: their wait overlaps those copies
    constexpr int kQ = 8 * D / (kWarps * 32);  // q elements a thread stages
    T qv[kQ];
#pragma unroll
    for (int j = 0; j < kQ; ++j) {
        const int i = threadIdx.x + j * kWarps * 32, h = i / D, d = i % D;
        qv[j] = h < group ? q[b * args.stride_qb + (kvh * group + h) * args.stride_qh + d] : T(0.f);
    }

    // into a stage of shared memory: whole rows, 16 bytes a lane (and a token's K or V scale and zero)
    auto copy_tile = [&](int base, uint8_t* st) {
        const int64_t row0 = tile_row0(base);
        constexpr int kChunks = S::kRowBytes / 16;  // 16-byte pieces of a row
#pragma unroll
        for (int i = 0; i < kTile * kChunks / 32; ++i) {
            const int idx = i * 32 + lane, r = idx / kChunks, c = idx % kChunks;
            const int64_t src = token_row(row0, base, r) * S::kRowBytes + 16 * c;
            cp_async16(st + r * St::kKStride + 16 * c, kc + src);
            cp_async16(st + St::kV + r * St::kVStride + 16 * c, vc + src);
        }
        if constexpr (POLICY != 0) {
            const int r = lane % kTile;
            const int64_t row = token_row(row0, base, r);
            cp_async4(st + (lane < kTile ? St::kKsz : St::kVsz) + 4 * r, (lane < kTile ? ksz : vsz) + 2 * row);
        }
    };
    // a lane's V words of a tile in shared memory: rows 2t, 2t + 1, 2t + 8, 2t + 9
    auto read_v = [&](const uint8_t* st, uint32_t (&vw)[4][S::kVWords]) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
            load_words<S::kVBytes>(st + St::kV + (2 * t + (r % 2) + 8 * (r / 2)) * St::kVStride + g * S::kVBytes,
                                   vw[r]);
    };

    // the first kStages - 1 tiles set off before q is ready (taking the slice's next tile not yet taken
    // instead, through a shared counter, evened out the warps' ends but made int4 1-6 % slower: H100, 64 x 1k
    // 33.0 -> 34.9 us, 256 x 8k 823 -> 849; int8 equal)
    uint8_t* ring = stages + warp * kStages * St::kBytes;
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
        if (i < num_tiles) copy_tile(tile_base(i), ring + i * St::kBytes);
        cp_async_commit();
    }

#pragma unroll
    for (int j = 0; j < kQ; ++j) {
        const int i = tid + j * kWarps * 32;
        sq[i / D][i % D] = to_float(qv[j]);
    }
    __syncthreads();
    TRACE_STAMP(t_sync);
    if constexpr (kRotate) hadamard_shared_rows<D>(sq, group);  // q H (normalised below)

    const float qnorm = kRotate ? rsqrtf(static_cast<float>(D)) : 1.f;
    // q's fragment as the B operand of S^T = K Q^T, column g (head g; heads from group on are zero):
    // k slots (2t, 2t + 1) and (2t + 8, 2t + 9) of each k step; and sum(q) over the rounded values the
    // dots see (for the zeros of a quantized K)
    uint32_t qb[kSteps][2];
    float qsum = 0.f, qbias = 0.f;  // and the bias the codes carry in the dots (int4: 1024 low, 64 high)
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float x0 = sq[g][elem_of<POLICY, D>(t, s, 2 * r)] * qnorm;
            const float x1 = sq[g][elem_of<POLICY, D>(t, s, 2 * r + 1)] * qnorm;
            qb[s][r] = pack2<E>(x0, x1);
            const float2 back = std::is_same<E, __half>::value
                                    ? __half22float2(*reinterpret_cast<const __half2*>(&qb[s][r]))
                                    : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qb[s][r]));
            qsum += back.x + back.y;
            qbias += (POLICY == 4 && s % 2 ? kBias * kHighScale : kBias) * (back.x + back.y);
        }
    }
    qsum = quad_sum(qsum);  // head g's
    qbias = quad_sum(qbias);
    // This lane's columns of S^T and of O^T are heads 2t and 2t + 1 (h = 0, 1 below): their sums of q and
    // biases, running maxima (log2 units), and this lane's sums of p, of the terms outside the V dot and
    // (int4) of p times the V scale as the dot saw it.
    const float qs[2] = {__shfl_sync(0xffffffffu, qsum, 8 * t), __shfl_sync(0xffffffffu, qsum, 8 * t + 4)};
    const float qbs[2] = {__shfl_sync(0xffffffffu, qbias, 8 * t), __shfl_sync(0xffffffffu, qbias, 8 * t + 4)};
    TRACE_STAMP(t_q);
#ifdef LMDEPLOY_DECODE_TRACE
    uint64_t t_first = 0;  // when warp 0's first tile was in
#endif
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, lz[2] = {0.f, 0.f}, lps[2] = {0.f, 0.f};
    // O^T (head elements x heads), m-tile i: rows g and g + 8 are elements j = 2i and 2i + 1 of position
    // g's part (col_of), columns heads 2t and 2t + 1
    float o[kSteps][4];
#pragma unroll
    for (int i = 0; i < kSteps; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    for (int i = 0; i < num_tiles; ++i) {
        const int base = tile_base(i);
        const int ahead = i + kStages - 1;  // into the stage the previous tile used
        if (ahead < num_tiles) copy_tile(tile_base(ahead), ring + (ahead % kStages) * St::kBytes);
        cp_async_commit();
        cp_async_wait<kStages - 1>();  // tile i is in
        __syncwarp();
#ifdef LMDEPLOY_DECODE_TRACE
        if (i == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_first));
#endif
        const uint8_t* st = ring + (i % kStages) * St::kBytes;

        // S^T = K Q^T: rows g and g + 8 are the tile's tokens g and g + 8 (A: their K rows, read 16 bytes a
        // row at a time with the k steps those bytes feed), columns heads; sc[2 u + h] = (token g + 8u, head 2t + h)
        float sc[4] = {0.f, 0.f, 0.f, 0.f}, sc_high[4] = {0.f, 0.f, 0.f, 0.f};  // int4: odd steps apart (16 c)
        constexpr int kChunkBytes = S::kKBytes < 16 ? S::kKBytes : 16;
        constexpr int kChunkSteps = kSteps * kChunkBytes / S::kKBytes;
#pragma unroll
        for (int ch = 0; ch < S::kKBytes / kChunkBytes; ++ch) {
            uint32_t kw[2][kChunkBytes / 4];
#pragma unroll
            for (int r = 0; r < 2; ++r)
                load_words<kChunkBytes>(st + (g + 8 * r) * St::kKStride + t * S::kKBytes + ch * kChunkBytes, kw[r]);
#pragma unroll
            for (int s = 0; s < kChunkSteps; ++s) {
                uint32_t a0, a1, a2, a3;
                k_operand<POLICY>(kw[0], s, a0, a2);
                k_operand<POLICY>(kw[1], s, a1, a3);
                const int step = ch * kChunkSteps + s;
                mma<E>(POLICY == 4 && step % 2 ? sc_high : sc, a0, a1, a2, a3, qb[step][0], qb[step][1]);
            }
        }
        if constexpr (POLICY == 4) {
#pragma unroll
            for (int r = 0; r < 4; ++r) sc[r] = fmaf(sc_high[r], kHighScale, sc[r]);
        }
        float2 ksz_u[2] = {make_float2(0.f, 0.f), make_float2(0.f, 0.f)}, vsz_u[2] = {ksz_u[0], ksz_u[1]};
        if constexpr (POLICY != 0) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                ksz_u[u] = load_sz(reinterpret_cast<const __half*>(st + St::kKsz), g + 8 * u);
                vsz_u[u] = load_sz(reinterpret_cast<const __half*>(st + St::kVsz), g + 8 * u);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int u = r / 2, h = r % 2;
            float x = sc[r];
            if constexpr (POLICY != 0) x = fmaf(ksz_u[u].x, x - qbs[h], ksz_u[u].y * qs[h]);
            sc[r] = base + g + 8 * u < end ? x * scale_log2 : -INFINITY;
        }
        // each head's maximum over the tile's 16 tokens (the 8 lanes of position t hold them); finite: the
        // tile's first token is in the slice
        float corr[2], p[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m[h], column_max(fmaxf(sc[h], sc[2 + h])));
            corr[h] = softmax_exp2(m[h] - m_new);  // 0 on the first tile (m = -inf)
            m[h] = m_new;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) p[r] = softmax_exp2(sc[r] - m[r % 2]);
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = fmaf(l[h], corr[h], p[h] + p[2 + h]);
        if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {  // most tiles raise no maximum
#pragma unroll
            for (int j = 0; j < kSteps; ++j) {
                o[j][0] *= corr[0], o[j][1] *= corr[1];
                o[j][2] *= corr[0], o[j][3] *= corr[1];
            }
        }
        uint32_t vw[4][S::kVWords];
        read_v(st, vw);
        __syncwarp();  // every lane has its words before the stage is refilled

        // P^T's rows g and g + 8 (heads 2t, 2t + 1 packed), scaled by each token's V scale for a quantized
        // cache, then transposed into P's rows: the B operand of O^T = V^T P^T (tokens 2t, 2t + 1 and
        // 2t + 8, 2t + 9 of head g)
        uint32_t pt[2];
        if constexpr (POLICY != 0) lz[0] *= corr[0], lz[1] *= corr[1];
        if constexpr (POLICY == 4) lps[0] *= corr[0], lps[1] *= corr[1];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if constexpr (POLICY == 0) {
                pt[u] = pack2<E>(p[2 * u], p[2 * u + 1]);
            } else {
                pt[u] = pack2<E>(p[2 * u] * vsz_u[u].x, p[2 * u + 1] * vsz_u[u].x);
                const float2 seen = __half22float2(*reinterpret_cast<const __half2*>(&pt[u]));  // as the dot sees p
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if constexpr (POLICY == 4) {  // the bias is taken off per row at the end (1024 or 64)
                        lz[h] = fmaf(p[2 * u + h], vsz_u[u].y, lz[h]);
                        lps[h] += h ? seen.y : seen.x;
                    } else {
                        lz[h] = fmaf(p[2 * u + h], vsz_u[u].y, fmaf(-kBias, h ? seen.y : seen.x, lz[h]));
                    }
                }
            }
        }
        const uint32_t pb0 = transpose8x8(pt[0]), pb1 = transpose8x8(pt[1]);
#pragma unroll
        for (int j = 0; j < kSteps; ++j)
            mma<E>(o[j], v_pair<POLICY, D>(vw[0], vw[1], 2 * j), v_pair<POLICY, D>(vw[0], vw[1], 2 * j + 1),
                   v_pair<POLICY, D>(vw[2], vw[3], 2 * j), v_pair<POLICY, D>(vw[2], vw[3], 2 * j + 1), pb0, pb1);
    }

    // merge the block's warps: each head's per-warp weights first, then every output element is a few FMAs
    // (the partial outputs reuse the stages: every warp must be done with its tiles)
    TRACE_STAMP(t_loop);
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int head = 2 * t + h;
        const float lsum = column_sum(l[h]), zsum = column_sum(lz[h]);
        const float psum = POLICY == 4 ? column_sum(lps[h]) : 0.f;  // rows g: 1024 + c, rows g + 8: 16 (64 + c)
        if (head < group) {
            if (g == 0) {
                sm_m[warp][head] = m[h];
                sm_l[warp][head] = lsum;
                sm_z[warp][head] = zsum;
            }
#pragma unroll
            for (int j = 0; j < kSteps; ++j) {
                sm_o[warp][head][col_of<POLICY, D>(g, 2 * j)] = POLICY == 4 ? o[j][h] - kBias * psum : o[j][h];
                sm_o[warp][head][col_of<POLICY, D>(g, 2 * j + 1)] =
                    POLICY == 4 ? fmaf(o[j][2 + h], kHighScale, -kBias * kHighScale * psum) : o[j][2 + h];
            }
        }
    }
    __syncthreads();
    if (tid < group) {
        float top = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) top = fmaxf(top, sm_m[w][tid]);
        float f[kWarps], total = 0.f, zero = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            f[w] = sm_m[w][tid] == -INFINITY ? 0.f : exp2f(sm_m[w][tid] - top);
            total = fmaf(sm_l[w][tid], f[w], total);
            zero = fmaf(sm_z[w][tid], f[w], zero);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sm_l[w][tid] = f[w] * inv;  // the weight of warp w's sums
        sm_z[0][tid] = zero * inv;
        sm_m[0][tid] = total > 0.f ? top + log2f(total) : -INFINITY;  // the slice's log2-sum-exp2
    }
    __syncthreads();
    for (int i = tid; i < group * D; i += blockDim.x) {
        const int h = i / D, d = i % D;
        float res = sm_z[0][h];
#pragma unroll
        for (int w = 0; w < kWarps; ++w) res = fmaf(sm_o[w][h][d], sm_l[w][h], res);
        const int head = kvh * group + h;
        if (slice.count == 1) {  // the whole context: no merge
            static_cast<T*>(args.out)[b * args.stride_ob + head * args.stride_oh + d] = from_float<T>(res);
        } else {
            const int64_t heads = static_cast<int64_t>(num_kv_heads) * group;
            float* pp = static_cast<float*>(args.partial) + ((b * heads + head) * num_splits + split) * (D + 1);
            pp[d] = res;
            if (d == 0) pp[D] = sm_m[0][h];
        }
    }
#ifdef LMDEPLOY_DECODE_TRACE
    __syncthreads();
    TRACE_STAMP(t_end);
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    if (tid == 0)  // warp 0's stamps
        printf("TRACE %u %d %llu %llu %llu %llu %llu %llu %llu\n", smid, pid, t_entry, t_len, t_sync, t_q, t_first,
               t_loop, t_end);
#endif
#endif
}

template <typename T, int POLICY, int D>
void launch(const DecodeArgs& a, cudaStream_t stream) {
    constexpr int smem = smem_bytes<POLICY, D>();
    // above 48 KB a block must be allowed it, once on each device (a function's attributes are a device's;
    // a failure shows as the launch's error)
    if constexpr (smem > 48 * 1024) {
        static std::atomic<uint64_t> allowed{0};  // a bit a device
        int device = 0;
        cudaGetDevice(&device);
        const uint64_t bit = uint64_t{1} << (device % 64);
        if (!(allowed.load(std::memory_order_relaxed) & bit)) {
            cudaFuncSetAttribute(decode_mma_kernel<T, POLICY, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            allowed.fetch_or(bit, std::memory_order_relaxed);
        }
    }
    launch_kernel_smem(decode_mma_kernel<T, POLICY, D>, dim3(a.batch * a.num_kv_heads * a.num_splits),
                       dim3(kWarps * 32), smem, stream, a.pdl != 0, a, a.scale * 1.4426950408889634f);
}

}  // namespace

bool decode_mma_supports(int block_size) {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    return major >= 8 && block_size % kTile == 0;
}

// Called by paged_decode_attention (decode_attention.cu) once it has checked the arguments; launches
// the mma kernel, and the slice merge is the caller's.
void paged_decode_attention_mma(const DecodeArgs& a, cudaStream_t stream) {
    with_type_and_policy(a.dtype, a.quant_policy, [&](auto t, auto policy) {
        using T = decltype(t);
        constexpr int kPolicy = decltype(policy)::value;
        if (a.head_dim == 64)
            launch<T, kPolicy, 64>(a, stream);
        else
            launch<T, kPolicy, 128>(a, stream);
    });
}

}  // namespace lmdeploy
