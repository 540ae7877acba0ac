/* Running one operation from a key/value description and named .npy-style inputs: the one code
 * path behind the golden runner (inputs from a case directory, outputs compared) and
 * `twin op` (inputs from --in flags, outputs saved). Keys and input names are those of
 * golden/FORMAT.md.
 *
 * Inputs are host tensors as .npy files hold them; exec converts leniently so hand-made files
 * work: f64 -> f32; f32 -> bf16/f16 (RNE) when `<p>_dtype`/`x_dtype` asks for it; u16 codes
 * -> bf16/f16 and u8 codes -> e4m3/e5m2/e8m0 by reinterpretation; i64 group sizes -> i32.
 * Anything else is an error naming the input, the dtype and the shape.
 *
 * Execution follows the golden contract: every input is copied into the context's memory,
 * every output is allocated there and poisoned with TW_POISON_BYTE (or filled with out_init),
 * the operation runs through the public API, and outputs come back to the host.
 */
#ifndef TWIN_GOLDEN_EXEC_H
#define TWIN_GOLDEN_EXEC_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_CASE_MAX_KEYS 64

typedef struct {
  int n;
  char key[TW_CASE_MAX_KEYS][48];
  char val[TW_CASE_MAX_KEYS][208];
} tw_case_keys;

/* Parses case.txt ("key = value" lines, '#' comments); TW_ERR_IO names the line. */
tw_status tw_case_keys_parse_file(const char *path, tw_case_keys *k);
const char *tw_case_get(const tw_case_keys *k, const char *key); /* NULL if absent */
tw_status tw_case_set(tw_case_keys *k, const char *key, const char *val); /* adds or replaces */

/* Named host tensors; data is malloc'd and owned by the set. */
#define TW_SET_MAX 40 /* EP on 8 ranks: 4 outputs per rank + out */
typedef struct {
  int n;
  char name[TW_SET_MAX][48];
  tw_tensor t[TW_SET_MAX];
  int optional[TW_SET_MAX]; /* an output that may have no expected file (a shared buffer) */
} tw_tensor_set;

void tw_tensor_set_init(tw_tensor_set *s);
void tw_tensor_set_free(tw_tensor_set *s);
const tw_tensor *tw_tensor_set_get(const tw_tensor_set *s, const char *name);

/* Where inputs come from: fills *out (host, malloc'd data, caller frees) and *found; a missing
 * optional input is found = 0 with TW_OK. */
typedef tw_status (*tw_input_fn)(void *user, const char *name, tw_tensor *out, int *found);

/* The ops: grouped_quantize, grouped_dequantize, gemm, grouped_gemm, grouped_gemm_wgrad,
 * delayed_scale_update (key "op"). Output names: grouped_quantize row_data, row_scale_inv,
 * col_data, col_scale_inv, amax (those the layout produces; amax unless key amax = 0);
 * grouped_dequantize and the GEMMs: out; delayed_scale_update: amax_history_out, scale_out.
 * Codes come back typed (e4m3, e8m0, bf16, ...); tw_npy_save writes them as raw integers. */
tw_status tw_exec_case(tw_ctx *ctx, const tw_case_keys *k, tw_input_fn input, void *user,
                       tw_tensor_set *outputs);

/* "gemm", "grouped_gemm", "grouped_gemm_wgrad": outputs compared against a bound. */
int tw_exec_op_is_gemm(const char *op);

#ifdef __cplusplus
}
#endif
#endif
