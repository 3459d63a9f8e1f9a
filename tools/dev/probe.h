/* What the probes in tools/dev share: a monotonic clock and a comparison
 * for qsort over doubles (medians and percentiles of call times). */
#ifndef FA_TOOLS_DEV_PROBE_H
#define FA_TOOLS_DEV_PROBE_H

#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#endif
