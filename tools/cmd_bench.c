/* `twin bench`: rates of the kernels next to a peer timed in the same run. It walks the
 * registry (ops/registry.h): each entry's bench_ref on the ref backend (ops/bench_ref.c), its
 * bench_gpu on the gpu backend (the kernels' owners, tools/bench_gpu_*.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/registry.h"
#include "tools/cli.h"
#include "twin/tw_pipeline.h"
#include "twin/tw_shard.h"

#pragma weak tw_gpu_device_count
int tw_gpu_device_count(void); /* gpu/probe.cu; absent from twin_cpu */

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin bench [--backend ref|gpu] [--op all|OP] [--iters N]\n"
          "                  [--warmup N] [--peers FILE] [--csv FILE]\n"
          "       twin bench --backend gpu --op ep [--tokens LIST] [--ep-version NAME] [--routing NAME]\n"
          "       twin bench --backend gpu --op moe [--ep N] [--peers FILE]\n"
          "       twin bench --backend gpu --op grouped_gemm|wgrad [--shapes GxMxNxK,...] [--peers FILE]\n"
          "       twin bench --backend gpu --op pipeline [--stages S] [--microbatches M] [--repeats R]\n"
          "                  [--delay 1|2] [--bsw] [--hidden E] [--ffn H] [--mb-rows N]\n"
          "                  [--mode auto|nccl|loopback] [--iters N] [--warmup N] [--csv FILE]\n"
          "\n"
          "One row per kernel and shape: median time, rate, the floor it is measured against,\n"
          "and a peer timed in the same run with ratio = peer_ms / ms (> 1: twin is faster).\n"
          "  --backend NAME  ref (default): grouped GEMM vs one cblas_sgemm of the same FLOPs,\n"
          "                  quantize vs memcpy of the same bytes; gpu: the GPU kernels' benches\n"
          "  --op NAME       all (default) or one registry entry (name or alias: grouped_gemm,\n"
          "                  quantize, gemm, ...); an entry without a bench on that backend\n"
          "                  says so on stderr; moe and pipeline (gpu) run only when named\n"
          "  --iters N       timed iterations, median reported (default 5)\n"
          "  --warmup N      untimed iterations first (default 1)\n"
          "  --peers FILE    gpu: peer timings measured on the same machine in the same run\n"
          "  --csv FILE      also write the rows as CSV\n"
          "\n"
          "--backend gpu --op pipeline: the circular pipeline scan (dense body y = x + gelu(x W1) W2,\n"
          "f32) forward + backward against the ideal from one layer's fwd+bwd timed alone, and the\n"
          "scan's peak device memory against tw_pipeline_peak_bytes. Configuration (checked first;\n"
          "a broken rule is named, exit 2):\n"
          "  --stages S          pipeline stages (default: the GPU count when >= 2, else 4)\n"
          "  --microbatches M    (default 8)     --repeats R (default 2)    --delay 1|2 (default 1)\n"
          "  --bsw               BSW window (default: plain FSDP, one gather per iteration)\n"
          "  --hidden E          row width (default 4096)   --ffn H  hidden width of the body (8192)\n"
          "  --mb-rows N         rows of one microbatch (default 2048)\n"
          "  --mode auto|nccl|loopback  nccl: one stage per GPU over NCCL (needs >= 2 GPUs);\n"
          "                      loopback: S stages as threads on GPU 0 (pipeline/loopback_comm.h);\n"
          "                      auto (default): nccl on >= 2 GPUs, else loopback\n"
          "\n"
          "--backend gpu --op ep: expert-parallel dispatch (bf16 and fp8 e4m3 with 1x128 scales),\n"
          "combine (bf16) and both backward ops (bf16), H 7168, top-8, 256 experts over the EP ranks\n"
          "(all visible GPUs, a power of two; one process, one thread per GPU), uniform and skewed\n"
          "routing. Per case: the slowest\n"
          "rank's median time, GB/s of the token rows received (one row per source token and\n"
          "destination rank, as DeepEP counts) with and without the rows that stay on their rank, and\n"
          "NCCL's all-to-all (grouped ncclSend/ncclRecv) moving the same per-peer bytes, timed in the\n"
          "same call (ratio = nccl_ms / ms), plus the one-direction NVLink copy rate (cudaMemcpyPeer).\n"
          "  --tokens LIST       tokens per rank, comma-separated (default 128,4096,16384)\n"
          "  --ep-version NAME   all (default), ep_nccl_slots or ep_nccl_lsa\n"
          "  --routing NAME      both (default), uniform or skewed (half the picks from experts 0-31)\n"
          "\n"
          "--backend gpu --op grouped_gemm (and wgrad): the dense floors, then each grouped shape\n"
          "(G groups of M rows, N, K: the forward [G*M, K] x [G, N, K]; the wgrad [G, K, N]).\n"
          "  --shapes LIST       up to 8 shapes GxMxNxK, comma-separated, in place of the five standard\n"
          "                      ones (gpu-machine.md); peers from tools/peers/torch_grouped_mm.py run with\n"
          "                      TWIN_PEER_GG_SHAPES=LIST (same list) match them by key\n"
          "\n"
          "--backend gpu --op moe: the MoE block's forward + backward against the torch block of --peers.\n"
          "  --ep N              ep = N over GPUs 0..N-1 (2..8; NCCL, one thread per GPU), 4096 tokens\n"
          "                      per GPU, E 32 and 256, bf16 and fp8 (default: one GPU, every shape)\n");
}

static const char *const pp_flags[] = {"--stages", "--microbatches", "--repeats", "--delay", "--hidden",
                                       "--ffn", "--mb-rows", "--mode", NULL};

static int pp_int(const char *flag, const char *v, long long lo, long long hi, long long *out) {
  char *end;
  long long x = strtoll(v, &end, 10);
  if (*end || end == v || x < lo || x > hi) {
    fprintf(stderr, "twin bench: %s wants an integer %lld..%lld, got '%s'\n", flag, lo, hi, v);
    return -1;
  }
  *out = x;
  return 0;
}

/* One --op pipeline option (a in pp_flags, value v) into pp; -1 after one stderr line. */
static int pp_option(tw_bench_pipeline *pp, const char *a, const char *v) {
  long long x = 0;
  if (!strcmp(a, "--mode")) {
    if (!strcmp(v, "auto")) pp->mode = TW_BENCH_PP_AUTO;
    else if (!strcmp(v, "nccl")) pp->mode = TW_BENCH_PP_NCCL;
    else if (!strcmp(v, "loopback")) pp->mode = TW_BENCH_PP_LOOPBACK;
    else {
      fprintf(stderr, "twin bench: --mode wants auto, nccl or loopback, got '%s'\n", v);
      return -1;
    }
    return 0;
  }
  int dims = !strcmp(a, "--hidden") || !strcmp(a, "--ffn") || !strcmp(a, "--mb-rows");
  if (pp_int(a, v, 1, dims ? 1LL << 20 : 4096, &x)) return -1;
  if (!strcmp(a, "--stages")) pp->stages = (int)x;
  else if (!strcmp(a, "--microbatches")) pp->microbatches = (int)x;
  else if (!strcmp(a, "--repeats")) pp->repeats = (int)x;
  else if (!strcmp(a, "--delay")) pp->delay = (int)x;
  else if (!strcmp(a, "--hidden")) pp->hidden = x;
  else if (!strcmp(a, "--ffn")) pp->ffn = x;
  else pp->mb_rows = x;
  return 0;
}

/* Fills the defaults (S from the GPUs this binary sees) and checks the configuration with the
 * pipeline's own rules on a pp=S mesh; 0, or -1 after one stderr line naming the rule. */
static int pp_resolve(tw_bench_pipeline *pp) {
  int gpus = tw_gpu_device_count ? tw_gpu_device_count() : 0;
  if (!pp->stages) pp->stages = gpus >= 2 && pp->mode != TW_BENCH_PP_LOOPBACK ? gpus : 4;
  if (!pp->microbatches) pp->microbatches = 8;
  if (!pp->repeats) pp->repeats = 2;
  if (!pp->delay) pp->delay = 1;
  if (!pp->hidden) pp->hidden = 4096;
  if (!pp->ffn) pp->ffn = 8192;
  if (!pp->mb_rows) pp->mb_rows = 2048;
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = pp->stages; c.microbatches = pp->microbatches; c.repeats = pp->repeats; c.delay = pp->delay;
  c.layers_per_stage = 1; c.layers = pp->stages * pp->repeats; c.mb_rows = pp->mb_rows;
  c.fsdp = pp->bsw ? TW_PIPELINE_FSDP_BSW : TW_PIPELINE_FSDP_PLAIN;
  tw_pipeline_body body;
  tw_mesh mesh;
  tw_axis ax = TW_AXIS_PP;
  tw_status st = tw_pipeline_dense_body(pp->hidden, pp->ffn, &body);
  if (st == TW_OK) st = tw_mesh_init(&mesh, 1, &ax, &pp->stages);
  if (st == TW_OK) st = tw_pipeline_check(&c, &mesh, &body);
  if (st != TW_OK) {
    fprintf(stderr, "twin bench --op pipeline: %s\n", tw_last_error());
    return -1;
  }
  if (pp->mode == TW_BENCH_PP_NCCL && gpus < 2) {
    fprintf(stderr, "twin bench --op pipeline: --mode nccl needs >= 2 GPUs (one stage per GPU), sees %d; "
                    "--mode loopback plays the S stages on one GPU\n", gpus);
    return -1;
  }
  if (pp->mode == TW_BENCH_PP_NCCL && pp->stages > gpus) {
    fprintf(stderr, "twin bench --op pipeline: --mode nccl runs one stage per GPU: S = %d needs %d GPUs, sees %d\n",
            pp->stages, pp->stages, gpus);
    return -1;
  }
  if (pp->mode == TW_BENCH_PP_AUTO) /* one stage per GPU where there are enough */
    pp->mode = gpus >= 2 && pp->stages >= 2 && pp->stages <= gpus ? TW_BENCH_PP_NCCL : TW_BENCH_PP_LOOPBACK;
  return 0;
}

static const char *const ep_flags[] = {"--tokens", "--ep-version", "--routing", NULL};

/* One --op ep option into ep; -1 after one stderr line naming the bad value. */
static int ep_option(tw_bench_ep *ep, const char *a, const char *v) {
  if (!strcmp(a, "--ep-version")) {
    if (!strcmp(v, "all")) ep->version = NULL;
    else if (!strcmp(v, "ep_nccl_slots") || !strcmp(v, "ep_nccl_lsa")) ep->version = v;
    else {
      fprintf(stderr, "twin bench: --ep-version wants all, ep_nccl_slots or ep_nccl_lsa, got '%s'\n", v);
      return -1;
    }
    return 0;
  }
  if (!strcmp(a, "--routing")) {
    if (!strcmp(v, "both")) ep->routing = 0;
    else if (!strcmp(v, "uniform")) ep->routing = 1;
    else if (!strcmp(v, "skewed")) ep->routing = 2;
    else {
      fprintf(stderr, "twin bench: --routing wants both, uniform or skewed, got '%s'\n", v);
      return -1;
    }
    return 0;
  }
  ep->ntokens = 0; /* --tokens */
  const char *p = v;
  for (;;) {
    char *end;
    long long x = strtoll(p, &end, 10);
    if (end == p || x < 1 || x > 1048576 || (*end && *end != ',') || ep->ntokens == 8) {
      fprintf(stderr, "twin bench: --tokens wants up to 8 comma-separated integers 1..1048576, got '%s'\n", v);
      return -1;
    }
    ep->tokens[ep->ntokens++] = x;
    if (!*end) return 0;
    p = end + 1;
  }
}

/* --shapes GxMxNxK[,...] into cfg (up to 8; each value 1..2^31-1, G <= 4096); -1 after one
 * stderr line naming the bad value. */
static int gg_shapes_option(tw_bench_cfg *cfg, const char *v) {
  cfg->ngg = 0;
  const char *p = v;
  for (;;) {
    long long d[4];
    int k = 0;
    for (; k < 4; k++) {
      char *end;
      d[k] = strtoll(p, &end, 10);
      if (end == p || d[k] < 1 || d[k] > 2147483647LL) break;
      p = end;
      if (k < 3) {
        if (*p != 'x') break;
        p++;
      }
    }
    if (k < 4 || d[0] > 4096 || cfg->ngg == 8 || (*p && *p != ',')) {
      fprintf(stderr, "twin bench: --shapes wants up to 8 comma-separated GxMxNxK (each >= 1, G <= 4096), got '%s'\n", v);
      return -1;
    }
    /* each operand (G*M x K, G x N x K, G*M x N, out G x K x N) below 2^34 elements: the products
     * stay far from overflow and a shape that cannot fit a GPU is refused here */
    const double lim = 17179869184.0, gm = (double)d[0] * (double)d[1];
    if (gm * (double)d[3] > lim || (double)d[0] * (double)d[2] * (double)d[3] > lim || gm * (double)d[2] > lim) {
      fprintf(stderr, "twin bench: --shapes %lldx%lldx%lldx%lld has an operand of more than 2^34 elements\n", d[0], d[1],
              d[2], d[3]);
      return -1;
    }
    for (k = 0; k < 4; k++) cfg->gg[cfg->ngg][k] = d[k];
    cfg->ngg++;
    if (!*p) return 0;
    p++;
  }
}

static int positive_int(const char *flag, const char *v, int *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || end == v || x < 0 || x > 1000) {
    fprintf(stderr, "twin bench: %s wants an integer 0..1000, got '%s'\n", flag, v);
    return -1;
  }
  *out = (int)x;
  return 0;
}

/* Calls each selected entry's bench on backend be once (entries may share a function). */
static int walk(const tw_bench_cfg *cfg, const char *op, tw_backend be, tw_ctx *ctx) {
  const void *done[32];
  int ndone = 0, failed = 0, ran = 0;
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    if (op && tw_op_find(op) != e) continue;
    const void *fn = be == TW_BACKEND_GPU ? (const void *)e->bench_gpu : (const void *)e->bench_ref;
    if (!fn) continue;
    int seen = 0;
    for (int k = 0; k < ndone; k++) seen |= done[k] == fn;
    if (seen) continue;
    if (ndone < 32) done[ndone++] = fn;
    tw_bench_cfg c = *cfg;
    c.op = op ? e->name : NULL;
    int rc = be == TW_BACKEND_GPU ? e->bench_gpu(&c) : e->bench_ref(&c, ctx);
    ran++;
    if (rc) failed = 1;
  }
  return failed ? TW_EXIT_FAIL : ran ? TW_EXIT_OK : TW_EXIT_USAGE;
}

int twin_cmd_bench(int argc, char **argv) {
  tw_bench_cfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.warmup = 1;
  cfg.iters = 5;
  FILE *csv = NULL;
  const char *backend = "ref", *csv_path = NULL, *pp_flag = NULL;
  tw_bench_pipeline pp;
  memset(&pp, 0, sizeof pp);
  tw_bench_ep epc;
  memset(&epc, 0, sizeof epc);
  const char *ep_flag = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (twin_is_help(a)) { usage(stdout); return TW_EXIT_OK; }
    if (!strcmp(a, "--bsw")) { pp.bsw = 1; pp_flag = a; continue; }
    static const char *const options[] = {"--backend", "--op", "--peers", "--csv", "--iters", "--warmup",
                                          "--stages", "--microbatches", "--repeats", "--delay", "--hidden",
                                          "--ffn", "--mb-rows", "--mode", "--tokens", "--ep-version",
                                          "--routing", "--ep", "--shapes", NULL};
    const char *v = twin_option_value("bench", argc, argv, &i, options);
    if (!v) return TW_EXIT_USAGE;
    int is_pp = 0, is_ep = 0;
    for (int k = 0; pp_flags[k]; k++) is_pp |= !strcmp(a, pp_flags[k]);
    for (int k = 0; ep_flags[k]; k++) is_ep |= !strcmp(a, ep_flags[k]);
    if (is_ep) {
      if (ep_option(&epc, a, v)) return TW_EXIT_USAGE;
      ep_flag = a;
    } else if (is_pp) {
      if (pp_option(&pp, a, v)) return TW_EXIT_USAGE;
      pp_flag = a;
    } else if (!strcmp(a, "--backend")) backend = v;
    else if (!strcmp(a, "--op")) cfg.op = v;
    else if (!strcmp(a, "--peers")) cfg.peers_json = v;
    else if (!strcmp(a, "--csv")) csv_path = v;
    else if (!strcmp(a, "--iters")) { if (positive_int(a, v, &cfg.iters) || cfg.iters < 1) return TW_EXIT_USAGE; }
    else if (!strcmp(a, "--shapes")) { if (gg_shapes_option(&cfg, v)) return TW_EXIT_USAGE; }
    else if (!strcmp(a, "--ep")) {
      long long n;
      if (pp_int(a, v, 2, 8, &n)) return TW_EXIT_USAGE;
      cfg.moe_ep = (int)n;
    }
    else if (positive_int(a, v, &cfg.warmup)) return TW_EXIT_USAGE;
  }
  const char *op = cfg.op && strcmp(cfg.op, "all") ? cfg.op : NULL;
  if (op && !tw_op_find(op)) {
    fprintf(stderr, "twin bench: unknown --op '%s' (all, %s)\n", op, tw_op_names());
    return TW_EXIT_USAGE;
  }
  const int is_pipeline = op && tw_op_find(op) == tw_op_find("pipeline");
  if (pp_flag && !is_pipeline) {
    fprintf(stderr, "twin bench: %s applies to --op pipeline only\n", pp_flag);
    return TW_EXIT_USAGE;
  }
  if (is_pipeline) {
    if (pp_resolve(&pp)) return TW_EXIT_USAGE;
    cfg.pipeline = &pp;
  }
  if (ep_flag && !(op && tw_op_find(op) == tw_op_find("ep"))) {
    fprintf(stderr, "twin bench: %s applies to --op ep only\n", ep_flag);
    return TW_EXIT_USAGE;
  }
  if (ep_flag) cfg.ep = &epc;
  if (cfg.ngg && !(op && (tw_op_find(op) == tw_op_find("grouped_gemm") || tw_op_find(op) == tw_op_find("wgrad")))) {
    fprintf(stderr, "twin bench: --shapes applies to --op grouped_gemm or wgrad only\n");
    return TW_EXIT_USAGE;
  }
  if (cfg.moe_ep && !(op && tw_op_find(op) == tw_op_find("moe"))) {
    fprintf(stderr, "twin bench: --ep applies to --op moe only\n");
    return TW_EXIT_USAGE;
  }
  tw_backend be;
  if (twin_parse_backend("bench", backend, 0, &be, NULL) != 0) return TW_EXIT_USAGE;
  if (cfg.ngg && be != TW_BACKEND_GPU) {
    fprintf(stderr, "twin bench: --shapes applies to --backend gpu only\n");
    return TW_EXIT_USAGE;
  }
  if (be == TW_BACKEND_GPU && !tw_backend_available(TW_BACKEND_GPU)) {
    fprintf(stderr, "twin bench: the gpu backend is not available here (no GPU visible or not built in)\n");
    return TW_EXIT_USAGE;
  }
  const tw_op_entry *only = op ? tw_op_find(op) : NULL;
  if (only && !(be == TW_BACKEND_GPU ? (const void *)only->bench_gpu : (const void *)only->bench_ref)) {
    fprintf(stderr, "twin bench: %s has no %s bench\n", only->name, tw_backend_name(be));
    return TW_EXIT_USAGE;
  }
  if (csv_path) {
    csv = fopen(csv_path, "w");
    if (!csv) {
      fprintf(stderr, "twin bench: cannot create %s\n", csv_path);
      return TW_EXIT_USAGE;
    }
    fprintf(csv, "op,shape,backend,version,ms,rate,unit,pct_of_floor,peer,peer_ms,ratio\n");
    cfg.csv = csv;
  }
  int rc;
  tw_ctx *ctx = NULL;
  if (be != TW_BACKEND_GPU) ctx = twin_open_ctx("bench", be, &rc); /* the gpu benches make their own */
  if (be == TW_BACKEND_GPU || ctx) {
    tw_bench_print_header();
    rc = walk(&cfg, op, be, ctx);
  }
  tw_ctx_destroy(ctx);
  if (csv) fclose(csv);
  return rc;
}
