// floorline_marlin: the Marlin kernels of the marlin-kernels 0.2.0 sdist (vLLM's gptq_marlin,
// Apache-2.0) registered as torch.ops.floorline_marlin.*, with TORCH_LIBRARY rather than
// pybind11, so that the library is loaded with torch.ops.load_library and needs no Python ABI.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

// Defined by gptq_marlin.cu and awq_marlin_repack.cu (global namespace, upstream signatures).
at::Tensor gptq_marlin_gemm(at::Tensor &a, at::Tensor &b_q_weight,
                               at::Tensor &b_scales, at::Tensor &b_zeros,
                               at::Tensor &g_idx, at::Tensor &perm,
                               at::Tensor &workspace, int64_t num_bits,
                               int64_t size_m, int64_t size_n, int64_t size_k,
                               bool is_k_full, bool has_zp, bool use_fp32_reduce);
at::Tensor awq_marlin_repack(at::Tensor &b_q_weight, int64_t size_k,
                                int64_t size_n, int64_t num_bits);

namespace {

// The dispatcher passes const references; the upstream functions take mutable ones.
at::Tensor gemm(const at::Tensor &a, const at::Tensor &b_q_weight,
                   const at::Tensor &b_scales, const at::Tensor &b_zeros,
                   const at::Tensor &g_idx, const at::Tensor &perm,
                   at::Tensor &workspace, int64_t num_bits, int64_t size_m,
                   int64_t size_n, int64_t size_k, bool is_k_full, bool has_zp,
                   bool use_fp32_reduce) {
  at::Tensor a_ = a, b_ = b_q_weight, s_ = b_scales, z_ = b_zeros, g_ = g_idx, p_ = perm;
  return gptq_marlin_gemm(a_, b_, s_, z_, g_, p_, workspace, num_bits, size_m, size_n,
                          size_k, is_k_full, has_zp, use_fp32_reduce);
}

at::Tensor repack(const at::Tensor &b_q_weight, int64_t size_k, int64_t size_n,
                     int64_t num_bits) {
  at::Tensor b_ = b_q_weight;
  return awq_marlin_repack(b_, size_k, size_n, num_bits);
}

}  // namespace

TORCH_LIBRARY(floorline_marlin, m) {
  m.def("gptq_marlin_gemm(Tensor a, Tensor b_q_weight, Tensor b_scales, Tensor b_zeros, "
        "Tensor g_idx, Tensor perm, Tensor(a!) workspace, int num_bits, int size_m, "
        "int size_n, int size_k, bool is_k_full, bool has_zp, bool use_fp32_reduce) -> Tensor");
  m.def("awq_marlin_repack(Tensor b_q_weight, int size_k, int size_n, int num_bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(floorline_marlin, CUDA, m) {
  m.impl("gptq_marlin_gemm", &gemm);
  m.impl("awq_marlin_repack", &repack);
}
