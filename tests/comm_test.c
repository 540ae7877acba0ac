/* The thread communicator (ref): every collective against its formula, in-place forms,
 * splits, the fixed reduction order, and the errors (bad arguments, timeouts, aborts). */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>
#include <time.h>

#include "twin/tw_comm.h"

#define MAXR 8

typedef struct {
  int n;
  tw_status (*body)(int rank, tw_comm *comm, tw_ctx *ctx, void *arg);
  void *arg;
} job;

static tw_status with_ctx(int rank, tw_comm *comm, void *arg) {
  job *j = (job *)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cfg));
  tw_status s = j->body(rank, comm, ctx, j->arg);
  tw_ctx_destroy(ctx);
  return s;
}

/* Runs body on n thread-ranks; returns tw_run_ranks' status. */
static tw_status run(int n, tw_status (*body)(int, tw_comm *, tw_ctx *, void *), void *arg, double timeout) {
  tw_comm *comms[MAXR];
  cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK, "%s", tw_last_error());
  for (int i = 0; i < n; i++) tw_comm_set_timeout(comms[i], timeout);
  job j = {n, body, arg};
  tw_status s = tw_run_ranks(n, comms, with_ctx, &j);
  for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
  return s;
}

#define CHECK(cond, ...) do { if (!(cond)) return tw_error(TW_ERR_INTERNAL, __VA_ARGS__); } while (0)

static float val(int rank, int i) { return (float)(rank * 100 + i) + 0.25f; }

static tw_status body_all_gather(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  int n = tw_comm_size(c);
  float send[3], recv[3 * MAXR];
  for (int i = 0; i < 3; i++) send[i] = val(r, i);
  TW_TRY(tw_all_gather(ctx, c, send, recv, 3, TW_F32));
  for (int j = 0; j < n; j++)
    for (int i = 0; i < 3; i++) CHECK(recv[j * 3 + i] == val(j, i), "rank %d: recv[%d][%d] = %g", r, j, i, recv[j * 3 + i]);
  /* in place: send is this rank's block of recv */
  float inplace[3 * MAXR];
  for (int i = 0; i < 3; i++) inplace[r * 3 + i] = val(r, i);
  TW_TRY(tw_all_gather(ctx, c, inplace + r * 3, inplace, 3, TW_F32));
  CHECK(memcmp(inplace, recv, sizeof(float) * 3 * (size_t)n) == 0, "rank %d: in-place all_gather differs", r);
  return TW_OK;
}

Test(comm, all_gather_concatenates_in_rank_order) {
  for (int n = 1; n <= MAXR; n *= 2) cr_assert_eq(run(n, body_all_gather, NULL, 10), TW_OK, "n=%d: %s", n, tw_last_error());
  cr_assert_eq(run(3, body_all_gather, NULL, 10), TW_OK, "%s", tw_last_error());
}

static tw_status body_reduce(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  int n = tw_comm_size(c);
  /* sum in rank order 0..n-1 in f32: an order-sensitive sum (1e8 + small values) */
  float x[2] = {r == 0 ? 1e8f : 1.0f + (float)r * 0.37f, (float)r - 1.5f};
  float y[2];
  TW_TRY(tw_all_reduce(ctx, c, x, y, 2, TW_F32, TW_REDUCE_SUM));
  float want = 1e8f, want1 = -1.5f;
  for (int j = 1; j < n; j++) { want = want + (1.0f + (float)j * 0.37f); want1 = want1 + ((float)j - 1.5f); }
  CHECK(memcmp(&y[0], &want, 4) == 0 && y[1] == want1, "rank %d: sum %.9g (want %.9g)", r, y[0], want);
  /* max, with a NaN on the last rank of element 1 */
  double m[2] = {(double)r, r == n - 1 ? NAN : -(double)r}, mo[2];
  TW_TRY(tw_all_reduce(ctx, c, m, mo, 2, TW_F64, TW_REDUCE_MAX));
  CHECK(mo[0] == n - 1 && isnan(mo[1]), "rank %d: max %g %g", r, mo[0], mo[1]);
  /* in place, integers */
  int64_t v[3] = {r, 2 * r, -r};
  TW_TRY(tw_all_reduce(ctx, c, v, v, 3, TW_I64, TW_REDUCE_SUM));
  int64_t s = (int64_t)n * (n - 1) / 2;
  CHECK(v[0] == s && v[1] == 2 * s && v[2] == -s, "rank %d: i64 in place %lld", r, (long long)v[0]);
  /* reduce-scatter: rank r gets block r summed */
  int32_t rs_send[2 * MAXR], rs_recv[2];
  for (int j = 0; j < n; j++) { rs_send[2 * j] = r + j; rs_send[2 * j + 1] = 10 * j; }
  TW_TRY(tw_reduce_scatter(ctx, c, rs_send, rs_recv, 2, TW_I32, TW_REDUCE_SUM));
  CHECK(rs_recv[0] == (int32_t)(s + n * r) && rs_recv[1] == 10 * r * n, "rank %d: reduce_scatter %d %d", r, rs_recv[0], rs_recv[1]);
  TW_TRY(tw_reduce_scatter(ctx, c, rs_send, rs_send + 2 * r, 2, TW_I32, TW_REDUCE_MAX));
  CHECK(rs_send[2 * r] == n - 1 + r && rs_send[2 * r + 1] == 10 * r, "rank %d: in-place reduce_scatter max", r);
  return TW_OK;
}

Test(comm, reductions_follow_rank_order_bit_for_bit) {
  for (int n = 1; n <= MAXR; n *= 2) cr_assert_eq(run(n, body_reduce, NULL, 10), TW_OK, "n=%d: %s", n, tw_last_error());
}

static tw_status body_all_to_all(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  int n = tw_comm_size(c);
  uint16_t send[2 * MAXR], recv[2 * MAXR];
  for (int j = 0; j < n; j++) { send[2 * j] = (uint16_t)(r * 16 + j); send[2 * j + 1] = (uint16_t)(1000 + r); }
  TW_TRY(tw_all_to_all(ctx, c, send, recv, 2, TW_BF16));
  for (int j = 0; j < n; j++) CHECK(recv[2 * j] == j * 16 + r && recv[2 * j + 1] == 1000 + j, "rank %d: block %d", r, j);
  /* all_to_allv: rank r sends j+1 elements of value r*10+j to rank j */
  int64_t sc[MAXR], sd[MAXR], rc[MAXR], rd[MAXR], so = 0, ro = 0;
  int32_t vs[64], vr[64];
  for (int j = 0; j < n; j++) {
    sc[j] = j + 1; sd[j] = so;
    for (int k = 0; k <= j; k++) vs[so + k] = r * 10 + j;
    so += j + 1;
    rc[j] = r + 1; rd[j] = ro; ro += r + 1;
  }
  TW_TRY(tw_all_to_allv(ctx, c, vs, sc, sd, vr, rc, rd, TW_I32));
  for (int j = 0; j < n; j++)
    for (int k = 0; k <= r; k++) CHECK(vr[rd[j] + k] == j * 10 + r, "rank %d: from %d got %d", r, j, vr[rd[j] + k]);
  return TW_OK;
}

Test(comm, all_to_all_and_v_route_blocks) {
  for (int n = 1; n <= MAXR; n *= 2) cr_assert_eq(run(n, body_all_to_all, NULL, 10), TW_OK, "n=%d: %s", n, tw_last_error());
}

static tw_status body_ppermute(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  int n = tw_comm_size(c);
  int perm[MAXR];
  for (int j = 0; j < n; j++) perm[j] = j == n - 1 ? -1 : j + 1; /* a shift; the last sends nothing */
  int64_t send[2] = {r, -r}, recv[2] = {99, 99};
  TW_TRY(tw_ppermute(ctx, c, send, recv, 2, TW_I64, perm));
  if (r == 0) CHECK(recv[0] == 0 && recv[1] == 0, "rank 0 receives nothing: zeros, got %lld", (long long)recv[0]);
  else CHECK(recv[0] == r - 1 && recv[1] == -(r - 1), "rank %d: got %lld", r, (long long)recv[0]);
  TW_TRY(tw_comm_barrier(ctx, c));
  TW_TRY(tw_comm_wait(ctx, c));
  return TW_OK;
}

Test(comm, ppermute_shifts_and_zero_fills) {
  for (int n = 1; n <= MAXR; n *= 2) cr_assert_eq(run(n, body_ppermute, NULL, 10), TW_OK, "n=%d: %s", n, tw_last_error());
}

/* Empty exchanges (an expert that receives no tokens): all counts 0 and no buffers at all, and
 * a ppermute of 0 elements; nothing is touched (ref passed NULL to memcpy here: UB). */
static tw_status body_empty_exchanges(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  int n = tw_comm_size(c);
  int64_t zeros[MAXR] = {0};
  TW_TRY(tw_all_to_allv(ctx, c, NULL, zeros, zeros, NULL, zeros, zeros, TW_F32));
  /* some ranks send nothing to some others, with real buffers elsewhere */
  int32_t vs[MAXR], vr[MAXR];
  int64_t sc[MAXR], sd[MAXR], rc[MAXR], rd[MAXR];
  for (int j = 0; j < n; j++) {
    sc[j] = (r + j) % 2;  /* rank r sends one element to rank j when r + j is odd */
    rc[j] = (j + r) % 2;
    sd[j] = rd[j] = j;
    vs[j] = r * 10 + j;
    vr[j] = -1;
  }
  TW_TRY(tw_all_to_allv(ctx, c, vs, sc, sd, vr, rc, rd, TW_I32));
  for (int j = 0; j < n; j++)
    CHECK(vr[j] == ((j + r) % 2 ? j * 10 + r : -1), "rank %d: from %d got %d", r, j, vr[j]);
  int perm[MAXR];
  for (int j = 0; j < n; j++) perm[j] = (j + 1) % n;
  TW_TRY(tw_ppermute(ctx, c, NULL, NULL, 0, TW_F32, perm));
  return TW_OK;
}

Test(comm, empty_all_to_allv_and_ppermute_touch_nothing) {
  for (int n = 1; n <= MAXR; n *= 2)
    cr_assert_eq(run(n, body_empty_exchanges, NULL, 10), TW_OK, "n=%d: %s", n, tw_last_error());
}

static tw_status body_split(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  /* 8 ranks as a 2x4 grid: rows (color r/4) ordered by reversed key */
  tw_comm *row = NULL, *col = NULL;
  TW_TRY(tw_comm_split(c, r / 4, -(r % 4), &row));
  TW_TRY(tw_comm_split(c, r % 4, r, &col));
  tw_status s = TW_OK;
  if (tw_comm_size(row) != 4 || tw_comm_rank(row) != 3 - r % 4 || tw_comm_size(col) != 2 || tw_comm_rank(col) != r / 4)
    s = tw_error(TW_ERR_INTERNAL, "rank %d: row %d/%d col %d/%d", r, tw_comm_rank(row), tw_comm_size(row),
                 tw_comm_rank(col), tw_comm_size(col));
  int32_t me = r, all[4];
  if (s == TW_OK) s = tw_all_gather(ctx, row, &me, all, 1, TW_I32);
  for (int j = 0; s == TW_OK && j < 4; j++)
    if (all[j] != (r / 4) * 4 + 3 - j) s = tw_error(TW_ERR_INTERNAL, "rank %d: row member %d is %d", r, j, all[j]);
  int32_t sum = r;
  if (s == TW_OK) s = tw_all_reduce(ctx, col, &sum, &sum, 1, TW_I32, TW_REDUCE_SUM);
  if (s == TW_OK && sum != 2 * (r % 4) + 4) s = tw_error(TW_ERR_INTERNAL, "rank %d: column sum %d", r, sum);
  tw_comm_destroy(row);
  tw_comm_destroy(col);
  return s;
}

Test(comm, split_groups_by_color_ordered_by_key) {
  cr_assert_eq(run(8, body_split, NULL, 10), TW_OK, "%s", tw_last_error());
}

/* Three ppermutes in one call (a right shift, a left rotation, the last rank to the first)
 * give what three tw_ppermute calls give; bad groups are refused with the op named. */
static tw_status body_ppermute_n(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  int n = tw_comm_size(c);
  int right[MAXR], left[MAXR], last[MAXR];
  for (int j = 0; j < n; j++) {
    right[j] = j == n - 1 ? -1 : j + 1;
    left[j] = (j + n - 1) % n;
    last[j] = j == n - 1 ? 0 : -1;
  }
  int64_t a[2] = {r, -r}, b[2] = {10 + r, 20 + r}, cc[2] = {100 + r, 200 + r};
  int64_t ra[2] = {99, 99}, rb[2] = {99, 99}, rc[2] = {99, 99};
  const void *snd[3] = {a, b, cc};
  void *rcv[3] = {ra, rb, rc};
  const int *perms[3] = {right, left, last};
  TW_TRY(tw_ppermute_n(ctx, c, 3, snd, rcv, 2, TW_I64, perms));
  if (r == 0) CHECK(ra[0] == 0 && ra[1] == 0, "rank 0: shift gives zeros, got %lld", (long long)ra[0]);
  else CHECK(ra[0] == r - 1 && ra[1] == -(r - 1), "rank %d: shift got %lld", r, (long long)ra[0]);
  int from = (r + 1) % n;
  CHECK(rb[0] == 10 + from && rb[1] == 20 + from, "rank %d: rotation got %lld", r, (long long)rb[0]);
  if (r == 0) CHECK(rc[0] == 100 + n - 1, "rank 0: from the last got %lld", (long long)rc[0]);
  else CHECK(rc[0] == 0 && rc[1] == 0, "rank %d: receives nothing from the last: zeros", r);
  /* refused: n out of range, a recv overlapping another op's send, two recvs overlapping */
  tw_status s = tw_ppermute_n(ctx, c, 0, snd, rcv, 2, TW_I64, perms);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "n = 0"), "n = 0: %s", tw_last_error());
  s = tw_ppermute_n(ctx, c, TW_PPERMUTE_N_MAX + 1, snd, rcv, 2, TW_I64, perms);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "n = 9"), "n = 9: %s", tw_last_error());
  s = tw_ppermute_n(ctx, c, 3, NULL, rcv, 2, TW_I64, perms);
  CHECK(s == TW_ERR_NULL && strstr(tw_last_error(), "array is NULL"), "NULL send array: %s", tw_last_error());
  s = tw_ppermute_n(ctx, c, 3, snd, rcv, 2, TW_I64, NULL);
  CHECK(s == TW_ERR_NULL && strstr(tw_last_error(), "array is NULL"), "NULL perm array: %s", tw_last_error());
  void *bad[3] = {ra, (void *)a, rc};
  s = tw_ppermute_n(ctx, c, 3, snd, bad, 2, TW_I64, perms);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "recv of op 1 overlaps send of op 0"), "overlap: %s",
        tw_last_error());
  void *twice[3] = {ra, ra + 1, rc};
  s = tw_ppermute_n(ctx, c, 3, snd, twice, 2, TW_I64, perms);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "recv of ops 0 and 1 overlap"), "recvs: %s", tw_last_error());
  int dup[MAXR];
  for (int j = 0; j < n; j++) dup[j] = 0;
  const int *bad_perm[3] = {right, dup, last};
  s = tw_ppermute_n(ctx, c, 3, snd, rcv, 2, TW_I64, bad_perm);
  if (n > 1) CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "ppermute_n op 1: ranks 0 and 1 both send to rank 0"),
                   "perm: %s", tw_last_error());
  return TW_OK;
}

Test(comm, ppermute_n_equals_separate_ppermutes) {
  for (int n = 1; n <= MAXR; n *= 2) cr_assert_eq(run(n, body_ppermute_n, NULL, 10), TW_OK, "n=%d: %s", n, tw_last_error());
}

static tw_status body_bad_args(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  uint16_t h[4] = {0};
  float f[4] = {0};
  tw_status s = tw_all_reduce(ctx, c, h, h, 4, TW_BF16, TW_REDUCE_SUM);
  CHECK(s == TW_ERR_DTYPE && strstr(tw_last_error(), "widen to f32"), "bf16 reduce: %s", tw_last_error());
  s = tw_all_gather(ctx, c, f, f, -1, TW_F32);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "count = -1"), "negative count: %s", tw_last_error());
  s = tw_all_gather(ctx, c, f, f, 2, TW_E2M1);
  CHECK(s == TW_ERR_DTYPE && strstr(tw_last_error(), "as u8"), "e2m1: %s", tw_last_error());
  s = tw_all_reduce(ctx, c, f, f + 1, 2, TW_F32, TW_REDUCE_SUM);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "overlap"), "overlap: %s", tw_last_error());
  s = tw_all_reduce(ctx, c, f, f, 2, TW_F32, (tw_reduce_op)7);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "reduce op 7"), "op: %s", tw_last_error());
  int perm[2] = {1, 1};
  s = tw_ppermute(ctx, c, f, f + 2, 1, TW_F32, perm);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "both send to rank 1"), "perm: %s", tw_last_error());
  s = tw_all_gather(NULL, c, f, f, 1, TW_F32);
  CHECK(s == TW_ERR_NULL, "NULL ctx");
  tw_comm *out;
  s = tw_comm_split(c, -2, 0, &out);
  CHECK(s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), "color = -2"), "color: %s", tw_last_error());
  /* mismatched all_to_allv counts: caught by the receiving rank */
  int64_t sc[2] = {1, 1}, sd[2] = {0, 1}, rc[2] = {r == 1 ? 2 : 1, 1}, rd[2] = {0, 2};
  float vs[2] = {1, 2}, vr[4];
  s = tw_all_to_allv(ctx, c, vs, sc, sd, vr, rc, rd, TW_F32);
  if (r == 1) CHECK(s == TW_ERR_SHAPE && strstr(tw_last_error(), "expects 2 elements from rank 0, which sends 1"), "a2av: %s", tw_last_error());
  else CHECK(s == TW_OK, "rank 0 a2av: %s", tw_last_error());
  return TW_OK;
}

Test(comm, bad_arguments_are_named) {
  cr_assert_eq(run(2, body_bad_args, NULL, 10), TW_OK, "%s", tw_last_error());
}

static tw_status body_missing_peer(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  if (r == 1) return TW_OK; /* never joins */
  float x = 1;
  tw_status s = tw_all_reduce(ctx, c, &x, &x, 1, TW_F32, TW_REDUCE_SUM);
  CHECK(s == TW_ERR_TIMEOUT && strstr(tw_last_error(), "aborted") && strstr(tw_last_error(), "waited"),
        "rank %d: expected a timeout, got %s: %s", r, tw_status_name(s), tw_last_error());
  /* the communicator stays aborted: the next call fails at once */
  s = tw_comm_barrier(ctx, c);
  CHECK(s == TW_ERR_TIMEOUT, "rank %d: second call after abort: %s", r, tw_status_name(s));
  return TW_OK;
}

Test(comm, a_missing_peer_times_out_instead_of_hanging) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  cr_assert_eq(run(3, body_missing_peer, NULL, 0.2), TW_OK, "%s", tw_last_error());
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  cr_assert(dt < 5.0, "took %.2f s", dt);
}

static tw_status body_one_fails(int r, tw_comm *c, tw_ctx *ctx, void *arg) {
  if (r == 2) return tw_error(TW_ERR_SHAPE, "rank 2 found a bad shape");
  float x = 1;
  return tw_all_reduce(ctx, c, &x, &x, 1, TW_F32, TW_REDUCE_SUM);
}

Test(comm, a_failing_rank_aborts_the_others_and_its_error_is_reported) {
  tw_status s = run(4, body_one_fails, NULL, 30);
  cr_assert_eq(s, TW_ERR_SHAPE, "%s", tw_status_name(s));
  cr_assert(strstr(tw_last_error(), "rank 2 found a bad shape"), "%s", tw_last_error());
}

Test(comm, init_and_query) {
  tw_comm *c[2];
  cr_assert_eq(tw_comm_init_threads(0, c), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "nranks = 0"));
  cr_assert_eq(tw_comm_init_threads(2, c), TW_OK);
  cr_assert_eq(tw_comm_size(c[1]), 2);
  cr_assert_eq(tw_comm_rank(c[1]), 1);
  cr_assert_str_eq(tw_comm_kind(c[0]), "threads");
  cr_assert_eq(tw_comm_mem(c[0]), TW_MEM_HOST);
  cr_assert_str_eq(tw_reduce_op_name(TW_REDUCE_MAX), "max");
  tw_comm_destroy(c[0]);
  tw_comm_destroy(c[1]);
  cr_assert_eq(tw_comm_destroy(NULL), TW_OK);
}
