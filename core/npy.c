/* .npy reading and writing (tw_npy.h).
 *
 * File layout: "\x93NUMPY", major, minor, header length (u16 LE for 1.x, u32 LE for 2.x/3.x),
 * a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), } padded
 * with spaces to a 64-byte boundary and ended by '\n', then the raw C-order data.
 *
 * Every length, count and product is checked against the bytes actually present before
 * anything is read or allocated, so a hostile file is an error message, never an over-read.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "twin/tw_npy.h"

static const char npy_magic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

/* descr string <-> dtype; raw codes of 8/16-bit float formats travel as |u1 / <u2. */
static const struct {
  const char *descr;
  tw_dtype dtype;
} npy_types[] = {
    {"<f8", TW_F64}, {"<f4", TW_F32}, {"<f2", TW_F16}, {"<i4", TW_I32}, {"<i8", TW_I64},
    {"|u1", TW_U8},  {"<u1", TW_U8},  {"<u2", TW_U16},
};

/* ---- a tiny parser for the header dict ----------------------------------------------------- */
typedef struct {
  const char *p, *end;
} cursor;

static void skip_space(cursor *c) {
  while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int take(cursor *c, char ch) {
  skip_space(c);
  if (c->p < c->end && *c->p == ch) {
    c->p++;
    return 1;
  }
  return 0;
}

/* A quoted Python string ('...' or "...") without escapes into buf. */
static int take_string(cursor *c, char *buf, size_t n) {
  skip_space(c);
  if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return 0;
  char q = *c->p++;
  size_t k = 0;
  while (c->p < c->end && *c->p != q) {
    if (*c->p == '\\' || k + 1 >= n) return 0;
    buf[k++] = *c->p++;
  }
  if (c->p >= c->end) return 0;
  c->p++;
  buf[k] = 0;
  return 1;
}

static int take_word(cursor *c, const char *w) {
  skip_space(c);
  size_t n = strlen(w);
  if ((size_t)(c->end - c->p) >= n && memcmp(c->p, w, n) == 0) {
    c->p += n;
    return 1;
  }
  return 0;
}

/* (d0, d1, ...) with 0..TW_MAX_DIMS non-negative ints; Python's trailing comma allowed. */
static tw_status take_shape(cursor *c, const char *where, int *ndim, int64_t *shape) {
  if (!take(c, '(')) return tw_error(TW_ERR_IO, "%s: shape is not a tuple", where);
  *ndim = 0;
  for (;;) {
    if (take(c, ')')) return TW_OK;
    skip_space(c);
    if (c->p >= c->end || *c->p < '0' || *c->p > '9')
      return tw_error(TW_ERR_IO, "%s: shape holds something other than a non-negative integer", where);
    int64_t v = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
      if (v > (INT64_MAX - 9) / 10) return tw_error(TW_ERR_IO, "%s: a shape dimension overflows int64", where);
      v = v * 10 + (*c->p++ - '0');
    }
    take_word(c, "L"); /* Python 2 longs */
    if (*ndim == TW_MAX_DIMS)
      return tw_error(TW_ERR_IO, "%s: more than %d dimensions (twin tensors have at most %d)", where,
                      TW_MAX_DIMS, TW_MAX_DIMS);
    shape[(*ndim)++] = v;
    if (take(c, ',')) continue;
    if (take(c, ')')) return TW_OK;
    return tw_error(TW_ERR_IO, "%s: shape tuple is not closed", where);
  }
}

static tw_status parse_header(const char *where, const char *h, size_t n, tw_dtype *dtype,
                              int *ndim, int64_t *shape) {
  cursor c = {h, h + n};
  int have_descr = 0, have_order = 0, have_shape = 0;
  if (!take(&c, '{')) return tw_error(TW_ERR_IO, "%s: header is not a dict literal", where);
  while (!take(&c, '}')) {
    char key[32], descr[32];
    if (!take_string(&c, key, sizeof key) || !take(&c, ':'))
      return tw_error(TW_ERR_IO, "%s: header dict does not parse near offset %zu", where, (size_t)(c.p - h));
    if (strcmp(key, "descr") == 0) {
      if (!take_string(&c, descr, sizeof descr))
        return tw_error(TW_ERR_IO, "%s: descr is not a simple type string (structured arrays are not supported)", where);
      size_t i = 0, nt = sizeof npy_types / sizeof npy_types[0];
      while (i < nt && strcmp(descr, npy_types[i].descr) != 0) i++;
      if (i == nt)
        return tw_error(TW_ERR_IO, "%s: dtype '%s' is not supported (want little-endian <f8 <f4 <f2 "
                        "<i4 <i8 |u1 <u2; raw bf16/fp8 codes as <u2/|u1)", where, descr);
      *dtype = npy_types[i].dtype;
      have_descr = 1;
    } else if (strcmp(key, "fortran_order") == 0) {
      if (take_word(&c, "False")) {
        have_order = 1;
      } else if (take_word(&c, "True")) {
        return tw_error(TW_ERR_IO, "%s: Fortran-order arrays are not supported (save with np.ascontiguousarray)", where);
      } else {
        return tw_error(TW_ERR_IO, "%s: fortran_order is neither True nor False", where);
      }
    } else if (strcmp(key, "shape") == 0) {
      TW_TRY(take_shape(&c, where, ndim, shape));
      have_shape = 1;
    } else {
      return tw_error(TW_ERR_IO, "%s: unexpected header key '%s'", where, key);
    }
    if (!take(&c, ',')) {
      if (take(&c, '}')) break;
      return tw_error(TW_ERR_IO, "%s: header dict does not parse near offset %zu", where, (size_t)(c.p - h));
    }
  }
  if (!have_descr || !have_order || !have_shape)
    return tw_error(TW_ERR_IO, "%s: header lacks %s", where,
                    !have_descr ? "'descr'" : !have_order ? "'fortran_order'" : "'shape'");
  return TW_OK;
}

static tw_status parse(const char *where, const void *bytes, size_t n, tw_tensor *out) {
  const unsigned char *b = (const unsigned char *)bytes;
  if (n < 10 || memcmp(b, npy_magic, sizeof npy_magic) != 0)
    return tw_error(TW_ERR_IO, "%s: not a .npy file (%s)", where,
                    n < 10 ? "shorter than the 10-byte preamble" : "bad magic");
  int major = b[6];
  size_t hlen, hstart;
  if (major == 1) {
    hlen = (size_t)b[8] | ((size_t)b[9] << 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (n < 12) return tw_error(TW_ERR_IO, "%s: truncated preamble (%zu bytes)", where, n);
    hlen = (size_t)b[8] | ((size_t)b[9] << 8) | ((size_t)b[10] << 16) | ((size_t)b[11] << 24);
    hstart = 12;
  } else {
    return tw_error(TW_ERR_IO, "%s: .npy format version %d.%d is not supported (1.0-3.0)", where,
                    major, b[7]);
  }
  if (hlen > n - hstart)
    return tw_error(TW_ERR_IO, "%s: header claims %zu bytes but the file has %zu after the preamble",
                    where, hlen, n - hstart);
  tw_dtype dtype = TW_F32;
  int ndim = 0;
  int64_t shape[TW_MAX_DIMS] = {0};
  TW_TRY(parse_header(where, (const char *)b + hstart, hlen, &dtype, &ndim, shape));
  size_t avail = n - hstart - hlen;
  size_t item = (size_t)tw_dtype_bits(dtype) / 8;
  /* numel * item must fit the bytes present; divide instead of multiplying to avoid overflow */
  size_t limit = avail / item, numel = 1;
  for (int d = 0; d < ndim; d++)
    if (shape[d] == 0) numel = 0;
  for (int d = 0; d < ndim && numel > 0; d++) {
    size_t dim = (size_t)shape[d];
    numel = numel > limit / dim ? limit + 1 : numel * dim; /* saturates past the limit */
  }
  if (numel > limit)
    return tw_error(TW_ERR_IO, "%s: truncated: shape needs more than the %zu data bytes present",
                    where, avail);
  size_t need = numel * item;
  if (need != avail)
    return tw_error(TW_ERR_IO, "%s: %zu bytes after the data (shape needs %zu of the %zu present)",
                    where, avail - need, need, avail);
  void *data = NULL;
  if (need > 0) {
    data = malloc(need);
    if (!data) return tw_error(TW_ERR_MEMORY, "%s: out of memory for %zu bytes", where, need);
    memcpy(data, b + hstart + hlen, need);
  }
  memset(out, 0, sizeof *out);
  out->data = data;
  out->dtype = dtype;
  out->ndim = ndim;
  for (int d = 0; d < ndim; d++) out->shape[d] = shape[d];
  out->mem = TW_MEM_HOST;
  return TW_OK;
}

tw_status tw_npy_parse(const void *bytes, size_t n, tw_tensor *out) {
  if (!out) return tw_error(TW_ERR_NULL, "npy_parse: out is NULL");
  if (!bytes && n > 0) return tw_error(TW_ERR_NULL, "npy_parse: bytes is NULL");
  return parse("npy_parse", bytes ? bytes : "", n, out);
}

tw_status tw_npy_load(const char *path, tw_tensor *out) {
  if (!path || !out) return tw_error(TW_ERR_NULL, "npy_load: NULL argument");
  /* the whole path as given (the message holds 1023 bytes; longer ones are cut there) */
  char where[1040];
  snprintf(where, sizeof where, "npy_load %s", path);
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return tw_error(TW_ERR_IO, "%s: is a directory", where);
  FILE *f = fopen(path, "rb");
  if (!f) return tw_error(TW_ERR_IO, "%s: cannot open (%s)", where, strerror(errno));
  unsigned char *buf = NULL;
  size_t n = 0, cap = 0;
  /* read to EOF instead of trusting ftell: works for pipes and files that change size */
  for (;;) {
    if (n == cap) {
      size_t ncap = cap ? cap * 2 : 1 << 16;
      unsigned char *nb = (unsigned char *)realloc(buf, ncap);
      if (!nb) {
        free(buf);
        fclose(f);
        return tw_error(TW_ERR_MEMORY, "%s: out of memory after %zu bytes", where, n);
      }
      buf = nb;
      cap = ncap;
    }
    size_t got = fread(buf + n, 1, cap - n, f);
    n += got;
    if (got == 0) break;
  }
  int err = ferror(f);
  fclose(f);
  if (err) {
    free(buf);
    return tw_error(TW_ERR_IO, "%s: read error", where);
  }
  tw_status s = parse(where, buf, n, out);
  free(buf);
  return s;
}

/* ---- saving --------------------------------------------------------------------------------- */
static const char *save_descr(tw_dtype t) {
  switch (t) {
    case TW_F64: return "<f8";
    case TW_F32: return "<f4";
    case TW_BF16: case TW_F16: case TW_U16: return "<u2";
    case TW_I32: return "<i4";
    case TW_I64: return "<i8";
    case TW_U8: case TW_E4M3: case TW_E5M2: case TW_E8M0: case TW_E2M1: return "|u1";
    default: return NULL;
  }
}

tw_status tw_npy_save(const char *path, const tw_tensor *t) {
  if (!path || !t) return tw_error(TW_ERR_NULL, "npy_save: NULL argument");
  const char *descr = save_descr(t->dtype);
  if (!descr) return tw_error(TW_ERR_DTYPE, "npy_save %s: unknown dtype %d", path, (int)t->dtype);
  if (t->ndim < 0 || t->ndim > TW_MAX_DIMS)
    return tw_error(TW_ERR_SHAPE, "npy_save %s: ndim %d (want 0..%d)", path, t->ndim, TW_MAX_DIMS);
  for (int d = 0; d < t->ndim; d++)
    if (t->shape[d] < 0)
      return tw_error(TW_ERR_SHAPE, "npy_save %s: negative dim %lld", path, (long long)t->shape[d]);
  if (t->mem != TW_MEM_HOST)
    return tw_error(TW_ERR_MEMORY, "npy_save %s: tensor lives in device memory; copy it to the host first", path);
  int64_t numel = tw_tensor_numel(t);
  if (numel > 0 && !t->data) return tw_error(TW_ERR_NULL, "npy_save %s: data is NULL", path);

  /* e2m1: two codes per byte along the last dim; an odd last dim gets a zero high nibble in
   * each row's last byte, so rows stay byte-aligned in the file. */
  int64_t shape[TW_MAX_DIMS];
  for (int d = 0; d < t->ndim; d++) shape[d] = t->shape[d];
  int64_t rows = 1, last = t->ndim ? t->shape[t->ndim - 1] : 1;
  for (int d = 0; d + 1 < t->ndim; d++) rows *= t->shape[d];
  if (t->dtype == TW_E2M1 && t->ndim > 0) shape[t->ndim - 1] = (last + 1) / 2;

  char header[512];
  int k = snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
  for (int d = 0; d < t->ndim; d++)
    k += snprintf(header + k, sizeof header - (size_t)k, t->ndim == 1 ? "%lld," : (d ? ", %lld" : "%lld"),
                  (long long)shape[d]);
  k += snprintf(header + k, sizeof header - (size_t)k, "), }");
  size_t total = 10 + (size_t)k + 1;
  size_t pad = (64 - total % 64) % 64;
  memset(header + k, ' ', pad);
  header[k + (int)pad] = '\n';
  size_t hlen = (size_t)k + pad + 1;

  FILE *f = fopen(path, "wb");
  if (!f) return tw_error(TW_ERR_IO, "npy_save %s: cannot create (%s)", path, strerror(errno));
  unsigned char pre[10];
  memcpy(pre, npy_magic, 6);
  pre[6] = 1;
  pre[7] = 0;
  pre[8] = (unsigned char)(hlen & 0xFF);
  pre[9] = (unsigned char)(hlen >> 8);
  int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(header, 1, hlen, f) == hlen;
  if (ok && t->dtype == TW_E2M1 && (last % 2) && rows > 1) {
    const uint8_t *src = (const uint8_t *)t->data;
    for (int64_t r = 0; ok && r < rows; r++)
      for (int64_t j = 0; ok && j < last; j += 2) {
        int64_t i = r * last + j;
        uint8_t lo = (src[i >> 1] >> ((i & 1) * 4)) & 0xF, hi = 0;
        if (j + 1 < last) hi = (src[(i + 1) >> 1] >> (((i + 1) & 1) * 4)) & 0xF;
        uint8_t byte = (uint8_t)(lo | (hi << 4));
        ok = fwrite(&byte, 1, 1, f) == 1;
      }
  } else if (ok) {
    size_t bytes = tw_tensor_bytes(t);
    ok = bytes == 0 || fwrite(t->data, 1, bytes, f) == bytes;
  }
  if (fclose(f) != 0) ok = 0;
  if (!ok) return tw_error(TW_ERR_IO, "npy_save %s: write failed (%s)", path, strerror(errno));
  return TW_OK;
}
