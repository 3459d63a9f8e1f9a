/* A tiny test runner (util.h's tr_ functions), shared by test_flashattn and
 * the CUDA KV-cache tests:
 *
 *   PROGRAM [--quick] [-v] [--time] [--list] [--mutate-scale=X] [FILTER]
 *
 * FILTER selects cases whose name contains it; --quick skips the slow ones.
 * One line per failing case, then the closing line "N passed, N failed".
 * --mutate-scale=X multiplies the softmax scale of every tested run (never the
 * oracle's) by X: a deliberately broken library, to see the suite catch it. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util.h"

typedef struct tr_case {
  char *name;
  tr_fn fn;
  void *arg;
  int slow;
} tr_case;

static tr_case *g_cases;
static size_t g_ncases, g_cap;

static int g_failures; /* in the running case */
static int g_silent;
static int g_verbose;
static double g_mutate = 1.0;
static char g_first[1024]; /* first failure message of the running case */
static char g_ctx[256];
static const char *g_name;

void tr_add(const char *name, tr_fn fn, const void *arg, size_t argsize, int slow) {
  if (g_ncases == g_cap) {
    g_cap = g_cap ? 2 * g_cap : 256;
    g_cases = (tr_case *)realloc(g_cases, g_cap * sizeof *g_cases);
    if (!g_cases) exit(2);
  }
  tr_case *c = &g_cases[g_ncases++];
  size_t len = strlen(name) + 1;
  c->name = (char *)malloc(len);
  memcpy(c->name, name, len);
  c->fn = fn;
  c->arg = NULL;
  if (argsize) {
    c->arg = malloc(argsize);
    memcpy(c->arg, arg, argsize);
  }
  c->slow = slow;
}

void tr_fail(const char *fmt, ...) {
  g_failures++;
  if (g_silent) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (g_failures == 1) snprintf(g_first, sizeof g_first, "%s", msg);
  if (g_verbose) printf("  fail %s: %s\n", g_name, msg);
}

void tr_context(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_ctx, sizeof g_ctx, fmt, ap);
  va_end(ap);
}

int tr_failures(void) { return g_failures; }
void tr_reset_failures(int n) { g_failures = n; }
int tr_silent(int on) {
  int old = g_silent;
  g_silent = on;
  return old;
}
int tr_verbose(void) { return g_verbose; }
const char *tr_name(void) { return g_name ? g_name : ""; }
double tr_mutate_scale(void) { return g_mutate; }

static double now_s(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC); /* C11; wall time is fine for per-case timings */
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int tr_main(int argc, char **argv) {
  int quick = 0, list = 0, timing = 0;
  const char *filter = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick"))
      quick = 1;
    else if (!strcmp(argv[i], "-v"))
      g_verbose = 1;
    else if (!strcmp(argv[i], "--time"))
      timing = 1;
    else if (!strcmp(argv[i], "--list"))
      list = 1;
    else if (!strncmp(argv[i], "--mutate-scale=", 15))
      g_mutate = atof(argv[i] + 15);
    else if (argv[i][0] == '-') {
      fprintf(stderr, "usage: %s [--quick] [-v] [--time] [--list] [--mutate-scale=X] [FILTER]\n",
              argv[0]);
      return 2;
    } else
      filter = argv[i];
  }
  int passed = 0, failed = 0;
  double t_all = now_s();
  for (size_t i = 0; i < g_ncases; i++) {
    tr_case *c = &g_cases[i];
    if (filter && !strstr(c->name, filter)) continue;
    if (quick && c->slow) continue;
    if (list) {
      printf("%s%s\n", c->name, c->slow ? " (slow)" : "");
      continue;
    }
    g_name = c->name;
    g_failures = 0;
    g_first[0] = 0;
    g_ctx[0] = 0;
    double t0 = now_s();
    c->fn(c->arg);
    double dt = now_s() - t0;
    if (g_failures) {
      failed++;
      printf("FAIL %s: %s", c->name, g_first);
      if (g_failures > 1) printf(" [+%d more]", g_failures - 1);
      if (g_ctx[0]) printf(" (%s)", g_ctx);
      printf("\n");
    } else {
      passed++;
    }
    if (timing) printf("  %7.3fs %s\n", dt, c->name);
    fflush(stdout);
  }
  if (timing) printf("total %.2fs\n", now_s() - t_all);
  for (size_t i = 0; i < g_ncases; i++) {
    free(g_cases[i].name);
    free(g_cases[i].arg);
  }
  free(g_cases);
  if (list) return 0;
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
