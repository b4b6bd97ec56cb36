#pragma once
// Tensor-core products (sm_80 and later): mma.sync m16n8k8 with TF32 operands at fp32 accuracy
// for the folds, and m16n8k16 with bf16 operands for the reads of bf16 / fp8 state copies.
//
// A fold adds a rank-w update Σ_j a_j·b_jᵀ to every row of the state, 2·w flops per state
// element; on the CUDA cores that is most of a fold's instructions (every product also needs its
// operands from shared memory). TF32 keeps 10 of fp32's 23 mantissa bits, so an fp32 operand x
// is carried as two TF32 numbers, hi = tf32(x) and lo = tf32(x − hi), whose sum is x to ~2^-22
// relative, and a product as hi·hi' + lo·hi' (+ hi·lo' when both operands need two parts). Each
// TF32 product is exact in the fp32 accumulator, so the sum keeps fp32 accuracy: the error of
// the split is below fp32's own rounding of the products on the CUDA cores. A value that came
// from bf16 is already exact in TF32 (7 mantissa bits) and is used as it is.
//
// Fragment coordinates of m16n8k8 (lane = 4·g + t, g in [0, 8), t in [0, 4)), as the PTX ISA
// defines them:
//   A [16 rows × 8 k]:  a0 (g, t)  a1 (g + 8, t)  a2 (g, t + 4)  a3 (g + 8, t + 4)
//   B [8 k × 8 cols]:   b0 (t, g)  b1 (t + 4, g)
//   C [16 rows × 8 cols]: c0 (g, 2t)  c1 (g, 2t + 1)  c2 (g + 8, 2t)  c3 (g + 8, 2t + 1)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace replayssm::cuda {

/// Two e4m3 values (the low byte first) as a bf16 pair for mma_bf16, exactly: every e4m3 value
/// is a bf16 value (through f16, also exact, in hardware).
__device__ __forceinline__ std::uint32_t fp8x2_to_bf16x2(std::uint32_t pair) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const std::uint32_t*>(&b);
}

/// x rounded to TF32 (nearest, ties away), as the bits of an fp32 whose low 13 bits are zero.
__device__ __forceinline__ std::uint32_t to_tf32(float x) {
  std::uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

/// An fp32 operand as two TF32 parts: hi + lo = x to ~2^-22 relative.
struct Tf32Pair {
  std::uint32_t hi = 0, lo = 0;
  __device__ __forceinline__ explicit Tf32Pair(float x) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
  }
};

/// c += A·B for one m16n8k8 tile (fragments as above, TF32 bits in the operands).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the tuned kernels are built for sm_80+ only (CMAKE_CUDA_ARCHITECTURES)
#endif
}

/// c += A·B for one m16n8k16 tile with bf16 operands (two bf16 per register, the lower k in
/// the low half): a0 (g, 2t..2t+1)  a1 (g + 8, 2t..2t+1)  a2 (g, 2t+8..2t+9)  a3 (g + 8, ...);
/// b0 (k 2t..2t+1, n g)  b1 (k 2t+8..2t+9, n g); c as for m16n8k8. bf16 products are exact in
/// the fp32 accumulator.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

}  // namespace replayssm::cuda
