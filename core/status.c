/* Status codes and the thread-local last-error message. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "twin/tw_base.h"

static _Thread_local char tw_err_msg[TW_ERROR_MAX];

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

/* Formats into a local buffer first: callers wrap the previous message with context,
 * tw_error(s, "input '%s': %s", name, tw_last_error()), and vsnprintf into the buffer it
 * reads from is undefined behaviour (seen: the prefix doubled and the argument cut). */
tw_status tw_error(tw_status s, const char *fmt, ...) {
  char msg[sizeof tw_err_msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  memcpy(tw_err_msg, msg, sizeof msg);
  return s;
}
