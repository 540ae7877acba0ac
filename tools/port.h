/* `twin port`: the report a kernel engineer brings up on a new GPU (or any machine with
 * --backend ref). It walks the registry (ops/registry.h): every entry x kernel version is
 * checked against the oracle on a fixed case set (its golden cases, a fixed draw of fuzz cases)
 * and timed on its bench shapes against the ceilings measured in the same run.
 *   cmd_port.c         runs it and fills a port_report
 *   port_report.c      writes report.md and report.json (and asks tools/roofline.py for the plot)
 *   port_compare.c     `twin port --compare A.json B.json`
 *   bench_gpu_facts.c  the device facts of a GPU (only in //tools:twin) */
#ifndef TWIN_TOOLS_PORT_H
#define TWIN_TOOLS_PORT_H

#include "ops/registry.h"

typedef struct {
  char key[48];
  char val[160];
} port_fact;

/* One entry x version x input dtype (or the fuzz draw): how many cases ran and how they went. */
typedef struct {
  const tw_op_entry *op;
  char version[48];    /* "auto", a forced kernel name, or "ref" */
  char dtype[32];      /* "bf16", "e4m3 mxfp8", "f32->e5m2", or "fuzz seed 1" */
  int cases, passed, failed, unsupported;
  char why[240];       /* the first failure or unsupported reason */
} port_check;

/* One timed row and where it stands against the others of its op and shape. */
typedef struct {
  const tw_op_entry *op;
  tw_bench_row row;
  double ratio_default; /* ms of the default version / ms (> 1: faster than it), < 0 if none */
} port_time;

#define PORT_MAX_FACTS 32

typedef struct {
  const char *backend; /* "ref" or "gpu" */
  const char *filter;
  const char *peers_json; /* gpu benches' peer timings, or NULL */
  int quick;
  port_fact facts[PORT_MAX_FACTS];
  int nfacts;
  /* ceilings measured in this run (< 0: not measured) */
  double copy_gbs, dense_f32_tflops, dense_bf16_tflops, dense_fp8_tflops;
  port_check *checks;
  int nchecks, capchecks;
  port_time *times;
  int ntimes, captimes;
  double seconds;
} port_report;

void port_fact_add(port_report *r, const char *key, const char *fmt, ...);

/* Device facts of GPU 0 (name, SMs, memory, clocks, driver, CUDA, cuBLASLt, NCCL); 0 on
 * success. Defined in bench_gpu_facts.c, so only a build with the gpu backend has it. */
int tw_port_gpu_facts(port_report *r);

/* Writes DIR/report.md and DIR/report.json; 0 on success (else one line on stderr). */
int port_write(const port_report *r, const char *dir);
/* `twin port --compare A.json B.json`: exit code. */
int port_compare(const char *a_path, const char *b_path);

#endif
