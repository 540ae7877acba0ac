/* `twin op <name>`: one operation on .npy files, outputs written as .npy.
 *
 * The flags are the golden case keys (golden/FORMAT.md) spelled as options: --x-dtype bf16 is
 * the key x_dtype = bf16. The operation runs through golden/exec.h, the same path the golden
 * runner takes, so `twin op` and `twin check` can never disagree about what a key means. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "golden/exec.h"
#include "tools/cli.h"
#include "twin/tw_npy.h"

typedef struct {
  const char *key;
  const char *help;
} key_doc;

typedef struct {
  const char *cli;  /* name on the command line */
  const char *op;   /* case op */
  const char *what;
  const char *inputs[8];
  const key_doc *keys;
  const char *operands[3]; /* GEMM operands: each adds <p>_* keys and inputs */
} op_doc;

static const key_doc quantize_keys[] = {
    {"mode", "scaling: current, delayed, mxfp8, block1x128, block128x128 (required)"},
    {"qdtype", "e4m3 (default) or e5m2"},
    {"layout", "rowwise (default), colwise or rowwise_colwise"},
    {"pow2_scales", "0 (default) or 1: truncate current/block scales to powers of 2"},
    {"swizzled", "mxfp8 scale byte order: 1 = GEMM-swizzled (default), 0 = compact"},
    {"col_padded", "0 (default) or 1: colwise data token-padded, [K, 128*T_cap] (tensor and block modes)"},
    {"x_dtype", "f32, bf16 or f16; f32 values are rounded to it (RNE), u16 files are codes"},
    {"amax", "1 (default): also write the per-group amax; 0: do not request it"},
    {NULL, NULL}};
static const key_doc dequantize_keys[] = {
    {"mode", "scaling mode of the data (required)"},
    {"qdtype", "e4m3 (default) or e5m2"},
    {"colwise", "0 (default): data is the rowwise output; 1: the colwise output"},
    {"swizzled", "mxfp8 scale byte order, 1 (default) or 0"},
    {"col_padded", "colwise data: 1 if token-padded, [K, 128*T_cap] (default 0)"},
    {"rows", "M of the quantized source (required)"},
    {"cols", "K of the quantized source (required)"},
    {"out_dtype", "f32 (default), bf16 or f16"},
    {NULL, NULL}};
static const key_doc gemm_keys[] = {
    {"op_a", "N (default): a is [B?, M, K]; T: a is stored [B?, K, M]"},
    {"op_b", "N (default): b is [B?, K, N]; T: b is stored [B?, N, K]"},
    {"out_dtype", "f32 (default), bf16 or f16"},
    {"accumulate", "0 (default) or 1: add to out_init (then an out_init input is required)"},
    {NULL, NULL}};
static const key_doc grouped_keys[] = {
    {"rhs_op", "N (default): rhs is [G, K, N]; T: rhs is [G, N, K]"},
    {"out_dtype", "f32 (default), bf16 or f16"},
    {"accumulate", "0 (default) or 1: add to out_init"},
    {NULL, NULL}};
static const key_doc wgrad_keys[] = {
    {"lhs_op", "N (default): lhs is [M, K]; T: per-group transposed [K, m_g] blocks"},
    {"rhs_op", "N (default): rhs is [M, N]; T: per-group transposed [N, m_g] blocks"},
    {"out_dtype", "f32 (default), bf16 or f16"},
    {"accumulate", "0 (default) or 1: add to out_init"},
    {NULL, NULL}};
static const key_doc delayed_keys[] = {
    {"qdtype", "e4m3 (default) or e5m2: fixes fp8_max"},
    {"algo", "max (default) or most_recent"},
    {"margin", "scale = (fp8_max / amax) / 2^margin; default 0"},
    {NULL, NULL}};
static const key_doc operand_keys[] = {
    {"mode", "none (default: a plain f32/bf16/f16 operand) or a scaling mode"},
    {"dtype", "plain operand: f32, bf16 or f16 (f32 values are rounded to it)"},
    {"qdtype", "quantized operand: e4m3 (default) or e5m2"},
    {"colwise", "quantized operand: 1 if the data is the colwise output"},
    {"swizzled", "quantized mxfp8 operand: scale byte order, 1 (default) or 0"},
    {"col_padded", "quantized colwise operand (wgrad): 1 if token-padded, [C, 128*T_cap] (default 0)"},
    {"src_rows", "quantized operand: rows of the tensor that was quantized"},
    {"src_cols", "quantized operand: columns of the tensor that was quantized"},
    {NULL, NULL}};

static const key_doc router_keys[] = {
    {"topk", "k, experts per token (required)"},
    {"score", "softmax (default) or sigmoid"},
    {"pre_softmax", "softmax only: 1 = softmax over all E before top-k, 0 (default) = over the k chosen"},
    {"num_groups", "group-limited top-k: E splits into this many groups (0 = off, default)"},
    {"group_topk", "groups kept when num_groups > 0"},
    {"scaling_factor", "weights times this (default 1)"},
    {"logits_dtype", "f32 (default) or bf16 (u16 codes, or f32 values rounded to bf16)"},
    {"coeff", "also the load-balancing aux loss with this coefficient, and its gradient"},
    {"d_loss", "the aux loss's incoming gradient (default 1)"},
    {NULL, NULL}};
static const key_doc ep_keys[] = {
    {"ep_size", "ranks of the EP group, run as threads of the ref backend, 1..8 (required)"},
    {"experts", "E, experts in all; expert e lives on rank e / (E / ep_size) (required)"},
    {"alignment", "per-expert slab alignment, a power of two (default 1)"},
    {"recv_capacity", "receive rows per rank (default 0: the no-drop capacity)"},
    {"policy", "error (default) or drop: what a capacity smaller than the demand does"},
    {"tokens_dtype", "f32 (default) or bf16"},
    {"weighted", "ep_combine: 1 (default) weights by topk_weights; 0: TE's unweighted form"},
    {NULL, NULL}};

static const op_doc ops[] = {
    {"quantize", "grouped_quantize", "x [M, K] split by group_sizes -> fp8 data, scale_inv, amax",
     {"x", "group_sizes", "scale", NULL}, quantize_keys, {NULL}},
    {"dequantize", "grouped_dequantize", "fp8 data + scale_inv -> out [M, K]",
     {"data", "scale_inv", "group_sizes", NULL}, dequantize_keys, {NULL}},
    {"gemm", "gemm", "out [B?, M, N] = op(a) @ op(b)", {"out_init", NULL}, gemm_keys, {"a", "b", NULL}},
    {"grouped_gemm", "grouped_gemm", "out[o_g:o_g+m_g] = lhs[o_g:o_g+m_g] @ op(rhs[g])",
     {"group_sizes", "out_init", NULL}, grouped_keys, {"lhs", "rhs", NULL}},
    {"grouped_gemm_wgrad", "grouped_gemm_wgrad", "out[g] = lhs_g^T @ rhs_g, [G, K, N]",
     {"group_sizes", "out_init", NULL}, wgrad_keys, {"lhs", "rhs", NULL}},
    {"delayed_scale_update", "delayed_scale_update", "amax history roll and scale update",
     {"amax_history", "scale", "amax", NULL}, delayed_keys, {NULL}},
    {"router", "router", "logits [T, E] -> topk_idx, topk_weights, counts (+ d_logits, aux loss)",
     {"logits", "expert_bias", "d_topk_weights", NULL}, router_keys, {NULL}},
    {"ep_dispatch", "ep_dispatch", "tokens to the ranks of their experts: per-rank expert-major receive rows",
     {"tokens", "topk_idx", "topk_weights", NULL}, ep_keys, {NULL}},
    {"ep_combine", "ep_combine", "dispatch, then the expert outputs expert_out_<r> back to out [n*T, H]",
     {"tokens", "topk_idx", "topk_weights", "expert_out_<r>", NULL}, ep_keys, {NULL}},
};
#define N_OPS ((int)(sizeof ops / sizeof ops[0]))

static const char *input_help(const char *name) {
  if (!strcmp(name, "x")) return "[M, K] f32 values (or u16 codes with --x-dtype bf16|f16)";
  if (!strcmp(name, "group_sizes")) return "[G] i32 (or i64); quantize/dequantize default: one group of all rows";
  if (!strcmp(name, "scale")) return "[G] f32 stored scales (delayed mode)";
  if (!strcmp(name, "data")) return "u8 fp8 codes as quantize wrote them";
  if (!strcmp(name, "scale_inv")) return "f32, or u8 e8m0 codes for mxfp8";
  if (!strcmp(name, "out_init")) return "initial output (accumulate=1): f32 values or u16 codes";
  if (!strcmp(name, "amax_history")) return "[G, H] f32";
  if (!strcmp(name, "amax")) return "[G] f32 amax of this step";
  if (!strcmp(name, "logits")) return "[T, E] f32 (or u16 bf16 codes with --logits-dtype bf16)";
  if (!strcmp(name, "expert_bias")) return "[E] f32, sigmoid only: steers selection, no gradient";
  if (!strcmp(name, "d_topk_weights")) return "[T, k] f32: also write d_logits";
  if (!strcmp(name, "tokens")) return "[n*T, H] f32 (or bf16 codes): rank r holds rows r*T .. r*T+T-1";
  if (!strcmp(name, "topk_idx")) return "[n*T, k] i32 expert ids";
  if (!strcmp(name, "topk_weights")) return "[n*T, k] f32";
  if (!strcmp(name, "expert_out_<r>")) return "[R, H] f32 per rank r: the experts' outputs on its receive rows";
  return "";
}

static void dashed(const char *key, char *buf, size_t n) {
  snprintf(buf, n, "--%s", key);
  for (char *p = buf + 2; *p; p++)
    if (*p == '_') *p = '-';
}

static void op_usage(FILE *f, const op_doc *d) {
  char flag[96];
  fprintf(f, "usage: twin op %s --in NAME=FILE.npy ... --out-dir DIR [--backend ref|gpu] [options]\n", d->cli);
  fprintf(f, "  %s\n\ninputs (--in NAME=FILE.npy):\n", d->what);
  for (int p = 0; d->operands[p]; p++)
    fprintf(f, "  %-22s plain operand (f32 values, or u16 codes with --%s-dtype); quantized: %s_data, %s_scale_inv\n",
            d->operands[p], d->operands[p], d->operands[p], d->operands[p]);
  for (int i = 0; d->inputs[i]; i++) fprintf(f, "  %-22s %s\n", d->inputs[i], input_help(d->inputs[i]));
  fprintf(f, "\noptions:\n");
  fprintf(f, "  %-22s %s\n", "--backend NAME", "ref (default) or gpu");
  fprintf(f, "  %-22s %s\n", "--out-dir DIR", "where the outputs go as NAME.npy (created if missing; required)");
  for (int i = 0; d->keys[i].key; i++) {
    dashed(d->keys[i].key, flag, sizeof flag);
    strcat(flag, " V");
    fprintf(f, "  %-22s %s\n", flag, d->keys[i].help);
  }
  for (int p = 0; d->operands[p]; p++)
    for (int i = 0; operand_keys[i].key; i++) {
      char key[64];
      snprintf(key, sizeof key, "%s_%s", d->operands[p], operand_keys[i].key);
      dashed(key, flag, sizeof flag);
      strcat(flag, " V");
      fprintf(f, "  %-22s %s\n", flag, operand_keys[i].help);
    }
  fprintf(f, "\noutputs: ");
  if (!strcmp(d->op, "grouped_quantize")) fprintf(f, "row_data, row_scale_inv, col_data, col_scale_inv, amax (as the layout gives)\n");
  else if (!strcmp(d->op, "delayed_scale_update")) fprintf(f, "amax_history_out, scale_out\n");
  else if (!strcmp(d->op, "router")) fprintf(f, "topk_idx, topk_weights, counts; d_logits; aux_loss, aux_d_logits\n");
  else if (!strncmp(d->op, "ep_", 3))
    fprintf(f, "per rank r: recv_tokens_<r>, recv_weights_<r>, group_sizes_<r>, dropped_<r>%s\n",
            strcmp(d->op, "ep_combine") ? "" : "; out");
  else fprintf(f, "out\n");
  fprintf(f, "Codes are written as integers (fp8/e8m0 as u8, bf16/f16 as u16). Exit 0 on success, 2 on bad\n"
             "arguments or inputs (one line on stderr), 1 when the machine fails.\n");
}

static void ops_usage(FILE *f) {
  fprintf(f, "usage: twin op <name> --help | twin op <name> --in NAME=FILE.npy ... --out-dir DIR [options]\n\nnames:\n");
  for (int i = 0; i < N_OPS; i++) fprintf(f, "  %-22s %s\n", ops[i].cli, ops[i].what);
}

/* Is key one of the op's case keys (including <operand>_<key>)? */
static int known_key(const op_doc *d, const char *key) {
  for (int i = 0; d->keys[i].key; i++)
    if (!strcmp(d->keys[i].key, key)) return 1;
  for (int p = 0; d->operands[p]; p++) {
    size_t n = strlen(d->operands[p]);
    if (!strncmp(key, d->operands[p], n) && key[n] == '_')
      for (int i = 0; operand_keys[i].key; i++)
        if (!strcmp(key + n + 1, operand_keys[i].key)) return 1;
  }
  return 0;
}

static int known_input(const op_doc *d, const char *name) {
  for (int i = 0; d->inputs[i]; i++) {
    if (!strcmp(d->inputs[i], name)) return 1;
    const char *per_rank = strstr(d->inputs[i], "<r>"); /* expert_out_<r>: expert_out_0 ... */
    size_t n = per_rank ? (size_t)(per_rank - d->inputs[i]) : 0;
    if (per_rank && !strncmp(name, d->inputs[i], n) && name[n] >= '0' && name[n] <= '9') return 1;
  }
  for (int p = 0; d->operands[p]; p++) {
    char q[64];
    if (!strcmp(name, d->operands[p])) return 1;
    snprintf(q, sizeof q, "%s_data", d->operands[p]);
    if (!strcmp(name, q)) return 1;
    snprintf(q, sizeof q, "%s_scale_inv", d->operands[p]);
    if (!strcmp(name, q)) return 1;
  }
  return 0;
}

#define MAX_INPUTS 16
typedef struct {
  int n;
  const char *name[MAX_INPUTS];
  const char *path[MAX_INPUTS];
} file_inputs;

static tw_status load_named(void *user, const char *name, tw_tensor *out, int *found) {
  const file_inputs *in = (const file_inputs *)user;
  *found = 0;
  for (int i = 0; i < in->n; i++)
    if (!strcmp(in->name[i], name)) {
      tw_status s = tw_npy_load(in->path[i], out);
      if (s != TW_OK) return tw_error(s, "input '%s': %s", name, tw_last_error());
      *found = 1;
      return TW_OK;
    }
  return TW_OK;
}

int twin_cmd_op(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "twin op: missing operation name (twin op --help lists them)\n");
    return TW_EXIT_USAGE;
  }
  if (twin_is_help(argv[1])) {
    ops_usage(stdout);
    return TW_EXIT_OK;
  }
  const op_doc *d = NULL;
  for (int i = 0; i < N_OPS; i++)
    if (!strcmp(argv[1], ops[i].cli) || !strcmp(argv[1], ops[i].op)) d = &ops[i];
  if (!d) {
    fprintf(stderr, "twin op: unknown operation '%s' (twin op --help lists them)\n", argv[1]);
    return TW_EXIT_USAGE;
  }
  tw_case_keys keys;
  memset(&keys, 0, sizeof keys);
  tw_case_set(&keys, "op", d->op);
  file_inputs in = {0};
  const char *out_dir = NULL, *backend = "ref";
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    if (twin_is_help(a)) {
      op_usage(stdout, d);
      return TW_EXIT_OK;
    }
    if (strncmp(a, "--", 2) != 0) {
      fprintf(stderr, "twin op %s: unexpected argument '%s' (options start with --)\n", d->cli, a);
      return TW_EXIT_USAGE;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "twin op %s: %s needs a value\n", d->cli, a);
      return TW_EXIT_USAGE;
    }
    const char *v = argv[++i];
    if (!strcmp(a, "--in")) {
      const char *eq = strchr(v, '=');
      if (!eq || eq == v || !eq[1]) {
        fprintf(stderr, "twin op %s: --in wants NAME=FILE.npy, got '%s'\n", d->cli, v);
        return TW_EXIT_USAGE;
      }
      static char names[MAX_INPUTS][64];
      size_t n = (size_t)(eq - v);
      if (in.n == MAX_INPUTS || n >= sizeof names[0]) {
        fprintf(stderr, "twin op %s: too many inputs or name too long: '%s'\n", d->cli, v);
        return TW_EXIT_USAGE;
      }
      memcpy(names[in.n], v, n);
      names[in.n][n] = 0;
      if (!known_input(d, names[in.n])) {
        fprintf(stderr, "twin op %s: unknown input '%s' (twin op %s --help lists the inputs)\n", d->cli,
                names[in.n], d->cli);
        return TW_EXIT_USAGE;
      }
      for (int j = 0; j < in.n; j++)
        if (!strcmp(in.name[j], names[in.n])) {
          fprintf(stderr, "twin op %s: input '%s' given twice\n", d->cli, names[in.n]);
          return TW_EXIT_USAGE;
        }
      in.name[in.n] = names[in.n];
      in.path[in.n] = eq + 1;
      in.n++;
      continue;
    }
    if (!strcmp(a, "--out-dir")) { out_dir = v; continue; }
    if (!strcmp(a, "--backend")) { backend = v; continue; }
    char key[64];
    snprintf(key, sizeof key, "%s", a + 2);
    for (char *p = key; *p; p++)
      if (*p == '-') *p = '_';
    if (!known_key(d, key)) {
      fprintf(stderr, "twin op %s: unknown option '%s' (twin op %s --help lists the options)\n", d->cli, a, d->cli);
      return TW_EXIT_USAGE;
    }
    if (tw_case_set(&keys, key, v) != TW_OK) {
      fprintf(stderr, "twin op %s: %s\n", d->cli, tw_last_error());
      return TW_EXIT_USAGE;
    }
  }
  if (!out_dir) {
    fprintf(stderr, "twin op %s: --out-dir DIR is required\n", d->cli);
    return TW_EXIT_USAGE;
  }
  tw_backend b;
  if (twin_parse_backend("op", backend, 0, &b, NULL) != 0) return TW_EXIT_USAGE;
  if (mkdir(out_dir, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "twin op %s: cannot create --out-dir %s (%s)\n", d->cli, out_dir, strerror(errno));
    return TW_EXIT_USAGE;
  }
  int code;
  tw_ctx *ctx = twin_open_ctx("op", b, &code);
  if (!ctx) return code;
  tw_tensor_set outs;
  tw_tensor_set_init(&outs);
  tw_status s = tw_exec_case(ctx, &keys, load_named, &in, &outs);
  if (s != TW_OK) {
    fprintf(stderr, "twin op %s: %s\n", d->cli, tw_last_error());
    tw_tensor_set_free(&outs);
    tw_ctx_destroy(ctx);
    return twin_exit_for(s);
  }
  for (int i = 0; i < outs.n && s == TW_OK; i++) {
    char path[4096], shape[96];
    size_t len = strlen(out_dir);
    snprintf(path, sizeof path, "%s%s%s.npy", out_dir, len && out_dir[len - 1] == '/' ? "" : "/", outs.name[i]);
    s = tw_npy_save(path, &outs.t[i]);
    if (s == TW_OK) printf("%s %s\n", path, tw_tensor_str(&outs.t[i], shape, sizeof shape));
  }
  if (s != TW_OK) fprintf(stderr, "twin op %s: %s\n", d->cli, tw_last_error());
  tw_tensor_set_free(&outs);
  tw_ctx_destroy(ctx);
  return twin_exit_for(s);
}
