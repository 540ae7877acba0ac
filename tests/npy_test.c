/* .npy reading and writing (tw_npy.h): round trips of every dtype, files written by NumPy's
 * own conventions (v1/v2 headers, 0-d, trailing commas), and hostile files. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_npy.h"

/* A file image: preamble (version 1.0 or 2.0) + header text padded to 64 + data. */
static size_t make_npy(uint8_t *buf, int major, const char *header, const void *data, size_t n) {
  size_t pre = major == 1 ? 10 : 12, hl = strlen(header);
  size_t total = pre + hl + 1, pad = (64 - total % 64) % 64, hlen = hl + pad + 1;
  memcpy(buf, "\x93NUMPY", 6);
  buf[6] = (uint8_t)major;
  buf[7] = 0;
  buf[8] = (uint8_t)(hlen & 0xFF);
  buf[9] = (uint8_t)(hlen >> 8);
  if (major != 1) buf[10] = buf[11] = 0;
  memcpy(buf + pre, header, hl);
  memset(buf + pre + hl, ' ', pad);
  buf[pre + hlen - 1] = '\n';
  if (n) memcpy(buf + pre + hlen, data, n);
  return pre + hlen + n;
}

Test(npy, parse_f32_2d) {
  uint8_t buf[256];
  float d[6] = {1, 2, 3, 4, 5, 6};
  size_t n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", d, sizeof d);
  tw_tensor t;
  cr_assert_eq(tw_npy_parse(buf, n, &t), TW_OK, "%s", tw_last_error());
  cr_assert_eq(t.dtype, TW_F32);
  cr_assert_eq(t.ndim, 2);
  cr_assert_eq(t.shape[0], 2);
  cr_assert_eq(t.shape[1], 3);
  cr_assert_eq(t.mem, TW_MEM_HOST);
  cr_assert_eq(((float *)t.data)[5], 6.0f);
  free(t.data);
}

Test(npy, parse_v2_header_double_quotes_0d_and_1d) {
  uint8_t buf[256];
  int64_t v = -7;
  size_t n = make_npy(buf, 2, "{\"descr\": \"<i8\", \"shape\": (), \"fortran_order\": False}", &v, 8);
  tw_tensor t;
  cr_assert_eq(tw_npy_parse(buf, n, &t), TW_OK, "%s", tw_last_error());
  cr_assert_eq(t.ndim, 0);
  cr_assert_eq(tw_tensor_numel(&t), 1);
  cr_assert_eq(*(int64_t *)t.data, -7);
  free(t.data);
  uint8_t u[3] = {1, 2, 3};
  n = make_npy(buf, 3, "{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", u, 3);
  cr_assert_eq(tw_npy_parse(buf, n, &t), TW_OK, "%s", tw_last_error());
  cr_assert_eq(t.dtype, TW_U8);
  cr_assert_eq(t.ndim, 1);
  cr_assert_eq(t.shape[0], 3);
  free(t.data);
}

Test(npy, parse_zero_size_array) {
  uint8_t buf[256];
  size_t n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 5), }", NULL, 0);
  tw_tensor t;
  cr_assert_eq(tw_npy_parse(buf, n, &t), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_tensor_numel(&t), 0);
  cr_assert_eq(t.shape[1], 5);
  free(t.data);
}

static void expect_io(const uint8_t *buf, size_t n, const char *substr) {
  tw_tensor t;
  tt_expect_status(tw_npy_parse(buf, n, &t), TW_ERR_IO, substr);
}

Test(npy, hostile_files_are_io_errors) {
  uint8_t buf[512];
  float d[4] = {0};
  expect_io((const uint8_t *)"", 0, "shorter than the 10-byte preamble");
  expect_io((const uint8_t *)"\x93NUMPX\x01\x00\x10\x00", 10, "bad magic");
  size_t n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", d, sizeof d);
  buf[6] = 9;
  expect_io(buf, n, "version 9.0");
  buf[6] = 1;
  expect_io(buf, n - 1, "truncated");
  expect_io(buf, 40, "header claims 118 bytes");
  /* every prefix of a valid file is an error, never a crash or over-read */
  for (size_t k = 0; k < n; k++) {
    uint8_t *copy = (uint8_t *)malloc(k ? k : 1); /* exact size: ASan/valgrind see over-reads */
    memcpy(copy, buf, k);
    tw_tensor t;
    cr_assert_eq(tw_npy_parse(copy, k, &t), TW_ERR_IO, "prefix %zu", k);
    free(copy);
  }
  uint8_t big[600];
  memcpy(big, buf, n);
  memset(big + n, 0, 8);
  expect_io(big, n + 8, "8 bytes after the data");
}

Test(npy, unsupported_headers_name_the_problem) {
  uint8_t buf[512];
  float d[4] = {0};
  size_t n = make_npy(buf, 1, "{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", d, 16);
  expect_io(buf, n, "dtype '>f4' is not supported");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", d, 16);
  expect_io(buf, n, "Fortran-order");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 4), }", d, 16);
  expect_io(buf, n, "more than 4 dimensions");
  n = make_npy(buf, 1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }", d, 16);
  expect_io(buf, n, "structured");
  n = make_npy(buf, 1, "{'descr': '|O', 'fortran_order': False, 'shape': (4,), }", d, 16);
  expect_io(buf, n, "'|O'");
  n = make_npy(buf, 1, "{'descr': '<f4', 'shape': (4,), }", d, 16);
  expect_io(buf, n, "lacks 'fortran_order'");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-4,), }", d, 16);
  expect_io(buf, n, "non-negative integer");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'x': 1}", d, 16);
  expect_io(buf, n, "unexpected header key 'x'");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4, }", d, 16);
  expect_io(buf, n, "");
  n = make_npy(buf, 1, "['descr']", d, 16);
  expect_io(buf, n, "not a dict literal");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", d, 16);
  expect_io(buf, n, "overflows int64");
  /* huge shapes whose product overflows size_t: caught before any allocation */
  n = make_npy(buf, 1, "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4294967296), }", d, 16);
  expect_io(buf, n, "truncated");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,), }", d, 16);
  expect_io(buf, n, "truncated");
}

Test(npy, random_garbage_never_crashes) {
  uint8_t buf[256], good[256];
  float d[4] = {1, 2, 3, 4};
  size_t n = make_npy(good, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", d, 16);
  uint64_t s = 42;
  for (int it = 0; it < 20000; it++) {
    memcpy(buf, good, n);
    int flips = 1 + (int)(tt_rand_u64(&s) % 4);
    for (int f = 0; f < flips; f++) buf[tt_rand_u64(&s) % n] = (uint8_t)tt_rand_u64(&s);
    tw_tensor t;
    tw_status st = tw_npy_parse(buf, n, &t);
    cr_assert(st == TW_OK || st == TW_ERR_IO);
    if (st == TW_OK) free(t.data);
  }
}

Test(npy, save_load_round_trip_every_dtype) {
  char *dir = tt_make_tmpdir("npy");
  char path[512];
  struct { tw_dtype t; tw_dtype back; } cases[] = {
      {TW_F64, TW_F64}, {TW_F32, TW_F32}, {TW_BF16, TW_U16}, {TW_F16, TW_U16}, {TW_I32, TW_I32},
      {TW_I64, TW_I64}, {TW_U8, TW_U8},   {TW_U16, TW_U16},  {TW_E4M3, TW_U8}, {TW_E5M2, TW_U8},
      {TW_E8M0, TW_U8},
  };
  uint8_t data[3 * 5 * 8];
  for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 37 + 1);
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    tw_tensor t = tw_tensor_2d(data, cases[c].t, 3, 5, TW_MEM_HOST), back;
    tt_path(path, sizeof path, dir, tw_dtype_name(cases[c].t));
    cr_assert_eq(tw_npy_save(path, &t), TW_OK, "%s", tw_last_error());
    cr_assert_eq(tw_npy_load(path, &back), TW_OK, "%s", tw_last_error());
    cr_assert_eq(back.dtype, cases[c].back, "%s", tw_dtype_name(cases[c].t));
    cr_assert_eq(back.ndim, 2);
    cr_assert_eq(back.shape[0], 3);
    cr_assert_eq(back.shape[1], 5);
    cr_assert_eq(memcmp(back.data, data, tw_tensor_bytes(&t)), 0);
    tw_tensor view;
    cr_assert_eq(tw_tensor_view_as(&back, cases[c].t, &view), TW_OK);
    tt_expect_exact(&view, &t, tw_dtype_name(cases[c].t));
    free(back.data);
  }
  /* 0-d, 1-d, 4-d shapes */
  double one = 3.5;
  tw_tensor s = {&one, TW_F64, 0, {0}, TW_MEM_HOST}, back;
  tt_path(path, sizeof path, dir, "scalar.npy");
  cr_assert_eq(tw_npy_save(path, &s), TW_OK);
  cr_assert_eq(tw_npy_load(path, &back), TW_OK);
  cr_assert_eq(back.ndim, 0);
  cr_assert_eq(*(double *)back.data, 3.5);
  free(back.data);
  tw_tensor v = {data, TW_U8, 4, {2, 1, 3, 2}, TW_MEM_HOST};
  cr_assert_eq(tw_npy_save(path, &v), TW_OK);
  cr_assert_eq(tw_npy_load(path, &back), TW_OK);
  cr_assert_eq(back.ndim, 4);
  cr_assert_eq(back.shape[2], 3);
  free(back.data);
  free(dir);
}

Test(npy, save_e2m1_packs_rows) {
  char *dir = tt_make_tmpdir("npy");
  char path[512];
  tt_path(path, sizeof path, dir, "fp4.npy");
  /* 2 rows of 3 codes, flat-packed: codes 1 2 3 | 4 5 6 -> bytes 0x21 0x43 0x65 */
  uint8_t packed[3] = {0x21, 0x43, 0x65};
  tw_tensor t = tw_tensor_2d(packed, TW_E2M1, 2, 3, TW_MEM_HOST), back;
  cr_assert_eq(tw_npy_save(path, &t), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_npy_load(path, &back), TW_OK);
  cr_assert_eq(back.shape[1], 2); /* per row ceil(3/2) bytes: 0x21 0x03 | 0x54 0x06 */
  uint8_t want[4] = {0x21, 0x03, 0x54, 0x06};
  cr_assert_eq(memcmp(back.data, want, 4), 0);
  free(back.data);
  free(dir);
}

Test(npy, load_and_save_errors) {
  tw_tensor t;
  tt_expect_status(tw_npy_load("/nonexistent/x.npy", &t), TW_ERR_IO, "/nonexistent/x.npy: cannot open");
  tt_expect_status(tw_npy_load(NULL, &t), TW_ERR_NULL, NULL);
  float d = 0;
  tw_tensor s = tw_tensor_1d(&d, TW_F32, 1, TW_MEM_HOST);
  tt_expect_status(tw_npy_save("/nonexistent/dir/x.npy", &s), TW_ERR_IO, "cannot create");
  s.mem = TW_MEM_DEVICE;
  tt_expect_status(tw_npy_save("/tmp/x.npy", &s), TW_ERR_MEMORY, "device memory");
  s = tw_tensor_1d(NULL, TW_F32, 3, TW_MEM_HOST);
  tt_expect_status(tw_npy_save("/tmp/x.npy", &s), TW_ERR_NULL, "data is NULL");
  char *dir = tt_make_tmpdir("npy");
  char path[512];
  tt_path(path, sizeof path, dir, "bad.npy");
  tt_write_file(path, "not numpy at all", 16);
  tt_expect_status(tw_npy_load(path, &t), TW_ERR_IO, "bad.npy: not a .npy file (bad magic)");
  tt_expect_status(tw_npy_load(dir, &t), TW_ERR_IO, "is a directory");
  free(dir);
}
