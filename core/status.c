/* Status codes and the thread-local last-error message. */
#include <stdarg.h>
#include <stdio.h>

#include "twin/tw_base.h"

static _Thread_local char tw_err_msg[1024];

static const char *const tw_status_names[TW_STATUS_COUNT] = {
    "TW_OK",          "TW_ERR_INVALID_ARG", "TW_ERR_NULL",  "TW_ERR_SHAPE",
    "TW_ERR_DTYPE",   "TW_ERR_ALIGNMENT",   "TW_ERR_UNSUPPORTED", "TW_ERR_MEMORY",
    "TW_ERR_CUDA",    "TW_ERR_NCCL",        "TW_ERR_DEVICE", "TW_ERR_IO",
    "TW_ERR_TIMEOUT", "TW_ERR_INTERNAL",
};

const char *tw_status_name(tw_status s) {
  if ((int)s < 0 || s >= TW_STATUS_COUNT) return "TW_ERR_?";
  return tw_status_names[s];
}

const char *tw_last_error(void) { return tw_err_msg; }

void tw_clear_error(void) { tw_err_msg[0] = 0; }

tw_status tw_error(tw_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tw_err_msg, sizeof tw_err_msg, fmt, ap);
  va_end(ap);
  return s;
}
