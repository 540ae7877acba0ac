/* twin's one checker: every comparison of two results (golden vs ref, gpu vs ref, sharded vs
 * unsharded) goes through it, so every report has the same shape.
 *
 * Exact mode (quantized data, scales, amax, integer outputs): bitwise equality of each
 * element's storage. Bound mode (GEMMs): |got - expected| <= bound[i] elementwise, where the
 * bound comes from tw_gemm_error_bound(). NaN must meet NaN and +-inf the same inf in both
 * modes. Outputs are poisoned with TW_POISON_BYTE before a run; an element of `got` whose
 * bytes are all the poison byte while `expected` differs counts as unwritten.
 */
#ifndef TWIN_TW_CHECK_H
#define TWIN_TW_CHECK_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_POISON_BYTE 0xA5

typedef struct {
  int64_t count;            /* elements compared */
  int64_t mismatches;       /* elements out of bound (or not bit-equal) */
  int64_t nan_mismatches;   /* NaN on exactly one side */
  int64_t inf_mismatches;   /* inf on one side only, or of opposite sign */
  int64_t unwritten;        /* poison in got where expected is not poison */
  int64_t worst_index;      /* flat index of the worst element (-1 if none) */
  int64_t worst_coord[TW_MAX_DIMS];
  int ndim;
  double worst_got, worst_expected;
  double worst_err;         /* |got - expected| at the worst element */
  double worst_bound;       /* its bound (0 in exact mode) */
  double worst_ratio;       /* max err/bound over elements (exact mode: 0 or inf) */
  int passed;
} tw_check_report;

/* Host tensors of equal shape; dtypes must match (exact) or be any float dtypes (bound). */
tw_status tw_check_exact(const tw_tensor *got, const tw_tensor *expected, tw_check_report *r);
/* bound: f64 or f32 tensor with got's element count. A negative bound[i] demands exact
 * equality of the decoded values (elements the operation must leave untouched, whose expected
 * value is their initial content). */
tw_status tw_check_bound(const tw_tensor *got, const tw_tensor *expected,
                         const tw_tensor *bound, tw_check_report *r);

/* Per-element GEMM error bound for out[B?,M,N] = op(a) op(b), on host f64 inputs already
 * dequantized (a [B?,M,K] logical, b [B?,K,N] logical, row-major, ops applied by caller):
 *   e_acc      = gamma(K) * sum_k |a_ik||b_kj|
 *   bound[i,j] = e_acc + u_out * (|ref_ij| + e_acc) + tiny
 * with gamma(K) = K*u_acc / (1 - K*u_acc) (inf when K*u_acc >= 1), u_acc the accumulator's
 * unit roundoff (f32: 2^-24), u_out the output dtype's unit roundoff (f32 2^-24, bf16 2^-8,
 * f16 2^-11): rounding the accumulated value (off by at most e_acc) to the output, and tiny =
 * max(smallest normal f32, half the output's subnormal spacing) (a sum that underflows; f16:
 * 2^-25). abs_prod = sum |a||b| (+ |out_init| when accumulating), ref = the exact (f64)
 * result; both [count]. abs_prod[i] < 0 marks an element the operation must not write: its
 * bound is -1 (exact, see tw_check_bound). */
void tw_gemm_error_bound(const double *abs_prod, const double *ref, int64_t count, int64_t K,
                         double u_acc, tw_dtype out_dtype, double *bound);

/* The same for an accumulation promoted every `chunk` along K (tw_gemm.h, gg_wgmma_fp8): inside
 * a chunk the products are summed with unit u_chunk per add (n_in = min(K, chunk) products, plus
 * one add of the running partial per 32-deep instruction: n_in + ceil(n_in/32) adds); the
 * ceil(K/chunk) chunk sums are then combined in f32 with unit u_acc, plus `extra` further
 * f32 roundings (scale products, the final scale multiply, the accumulate add):
 *   g_in  = gamma(n_in + ceil(n_in/32), u_chunk),  g_out = gamma(ceil(K/chunk) + extra, u_acc)
 *   e_acc = (g_in + g_out * (1 + g_in)) * sum_k |a_ik||b_kj|
 * and bound[i] as in tw_gemm_error_bound with that e_acc. For quantized operands, abs_prod
 * must be the sum of the products' lifted magnitudes (tw_fp8_lift_subnormal_codes below). */
void tw_gemm_error_bound_promoted(const double *abs_prod, const double *ref, int64_t count, int64_t K,
                                  int64_t chunk, double u_chunk, double u_acc, int64_t extra,
                                  tw_dtype out_dtype, double *bound);

/* Hopper's fp8 tensor core aligns the products of one 32-deep instruction (and the running
 * partial) to the largest product's exponent fields, and in that alignment a subnormal code
 * counts at the smallest normal exponent (probe: tests/fp8_accum_gpu_test.c; zero codes do not
 * count). So the promoted model's rounding unit scales with each product's lifted magnitude
 * |a|^ |b|^, where |x|^ = max(|x|, 2^emin * scale) for a nonzero code (emin = -6 e4m3, -14
 * e5m2) and 0 for a zero code: abs_prod = sum |a|^ |b|^. Equal to sum |a||b| unless a code is
 * subnormal. This writes codes[0..n) with every nonzero subnormal code replaced by the smallest
 * normal code of its sign (zero, normal, inf and NaN codes unchanged; in place allowed):
 * dequantizing the copy with the operand's scales gives the lifted magnitudes. Errors:
 * TW_ERR_DTYPE unless qdtype is TW_E4M3 or TW_E5M2, TW_ERR_INVALID_ARG for n < 0, TW_ERR_NULL
 * for a NULL pointer with n > 0; nothing is written then. */
tw_status tw_fp8_lift_subnormal_codes(const uint8_t *codes, int64_t n, tw_dtype qdtype, uint8_t *out);

/* One line: "PASS 4096 elems, worst 1.2e-06 <= 3.1e-05 (ratio 0.04) at [3, 17]" or
 * "FAIL 12/4096 out of bound, 2 NaN, 0 inf, 5 unwritten; worst got=.. exp=.. at [..]". */
const char *tw_check_format(const tw_check_report *r, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
