// The Python module lmdeploy.devices.cuda._C: the compiled kernels, called with raw device pointers
// (tensor.data_ptr()) and the stream (torch.cuda.current_stream().cuda_stream), so that this module
// depends on no torch headers or ABI; lmdeploy/devices/cuda/compiled.py checks the tensors.
#include <pybind11/pybind11.h>

#include "ops.h"

namespace py = pybind11;
using lmdeploy::DecodeArgs;
using lmdeploy::RotaryFillArgs;

namespace {

const void* ptr(uintptr_t p) { return reinterpret_cast<const void*>(p); }

void paged_decode_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scale_zero,
                            uintptr_t v_scale_zero, uintptr_t partial, uintptr_t out, uintptr_t block_tables,
                            uintptr_t kv_lens, uintptr_t order, int dtype, int quant_policy, int batch, int num_heads,
                            int num_kv_heads, int head_dim, int block_size, int num_splits, int min_slice,
                            int64_t row_block, int64_t row_slot, int64_t row_head, int64_t stride_qb,
                            int64_t stride_qh, int64_t stride_ob, int64_t stride_oh, int64_t stride_bt, float scale,
                            uintptr_t stream, int kernel, int pdl) {
    DecodeArgs a{ptr(q), ptr(k_cache), ptr(v_cache), ptr(k_scale_zero), ptr(v_scale_zero),
                 reinterpret_cast<void*>(partial), reinterpret_cast<void*>(out), ptr(block_tables), ptr(kv_lens),
                 ptr(order), dtype, quant_policy, batch, num_heads, num_kv_heads, head_dim, block_size, num_splits,
                 min_slice, {row_block, row_slot, row_head}, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                 scale, kernel, pdl};
    lmdeploy::paged_decode_attention(a, reinterpret_cast<cudaStream_t>(stream));
}

void* mut(uintptr_t p) { return reinterpret_cast<void*>(p); }

void rotary_fill_kv(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t cos, uintptr_t sin,
                    uintptr_t slots, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scale_zero,
                    uintptr_t v_scale_zero, uintptr_t k_mean, int dtype, int quant_policy, int rotate_k,
                    int num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size,
                    int64_t row_block, int64_t row_slot, int64_t row_head, int64_t stride_qt, int64_t stride_qh,
                    int64_t stride_kt, int64_t stride_kh, int64_t stride_vt, int64_t stride_vh, int64_t stride_cos,
                    uintptr_t stream, int pdl) {
    RotaryFillArgs a{ptr(q), ptr(k), ptr(v), mut(out), ptr(cos), ptr(sin), ptr(slots), mut(k_cache), mut(v_cache),
                     mut(k_scale_zero), mut(v_scale_zero), ptr(k_mean), dtype, quant_policy, rotate_k, num_tokens,
                     num_heads, num_kv_heads, head_dim, block_size, {row_block, row_slot, row_head}, stride_qt,
                     stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, pdl};
    lmdeploy::rotary_fill_kv(a, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "lmdeploy's compiled CUDA kernels (csrc/cuda)";
    m.attr("MAX_DECODE_SPLITS") = lmdeploy::kMaxDecodeSplits;
    m.def("decode_attention_supports", &lmdeploy::decode_attention_supports, py::arg("dtype"),
          py::arg("quant_policy"), py::arg("head_dim"), py::arg("num_heads"), py::arg("num_kv_heads"));
    m.def("paged_decode_attention", &paged_decode_attention, "DeviceOps.paged_decode_attention on raw pointers",
          py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale_zero"), py::arg("v_scale_zero"),
          py::arg("partial"), py::arg("out"), py::arg("block_tables"), py::arg("kv_lens"), py::arg("order"),
          py::arg("dtype"), py::arg("quant_policy"), py::arg("batch"), py::arg("num_heads"),
          py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("num_splits"),
          py::arg("min_slice"), py::arg("row_block"), py::arg("row_slot"), py::arg("row_head"),
          py::arg("stride_qb"), py::arg("stride_qh"), py::arg("stride_ob"), py::arg("stride_oh"),
          py::arg("stride_bt"), py::arg("scale"), py::arg("stream"), py::arg("kernel") = 0, py::arg("pdl") = 0);
    m.attr("DECODE_KERNELS") = py::make_tuple("auto", "cuda_cores", "tensor_cores");
    m.def("rotary_fill_supports", &lmdeploy::rotary_fill_supports, py::arg("dtype"), py::arg("quant_policy"),
          py::arg("head_dim"));
    m.def("rotary_fill_kv", &rotary_fill_kv, "DeviceOps.rotary_fill_kv on raw pointers");
}
