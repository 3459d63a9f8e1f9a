/* Small problems on a busy host: times a forward + backward of small shapes
 * on 2 threads (fa_params.num_threads), call by call, first on a quiet
 * machine and then while one spinning process per core competes for every
 * core, and prints each shape's median, 90th percentile, maximum and mean.
 * A problem split over threads that another process keeps off the cores
 * waits for them at the region's end (a scheduler time slice, milliseconds);
 * one that runs on one thread does not.
 *   cc -O2 -fopenmp -Iinclude tools/dev/small_busy.c build/libflashattn.a -lm -o small_busy
 *   ./small_busy [calls per shape, 300] [threads, 2] */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "flashattn.h"
#include "probe.h"

static fa_tensor tensor(int64_t h, int64_t n, int64_t d) {
  fa_tensor t = {
      calloc((size_t)(h * n * d), sizeof(float)), FA_DTYPE_F32, 1, n, h, d, n * h * d, h * d, d};
  for (int64_t i = 0; i < h * n * d; i++) ((float *)t.data)[i] = (float)((i * 7919) % 97) / 97.0f;
  return t;
}

static void shape(int64_t h, int64_t n, int64_t d, int causal, int calls, int threads) {
  fa_params p;
  memset(&p, 0, sizeof p);
  p.causal = causal;
  p.num_threads = threads;
  fa_tensor q = tensor(h, n, d), k = tensor(h, n, d), v = tensor(h, n, d), o = tensor(h, n, d);
  fa_tensor dO = tensor(h, n, d), dq = tensor(h, n, d), dk = tensor(h, n, d), dv = tensor(h, n, d);
  float *lse = malloc(sizeof(float) * (size_t)(h * n));
  double *ms = malloc(sizeof(double) * (size_t)calls), sum = 0;
  for (int i = -10; i < calls; i++) {
    const double t0 = now();
    if (fa_forward(&p, &q, &k, &v, &o, lse) != FA_OK ||
        fa_backward(&p, &q, &k, &v, &o, &dO, lse, &dq, &dk, &dv) != FA_OK) {
      fprintf(stderr, "call failed: %s\n", fa_last_error());
      exit(1);
    }
    if (i >= 0) sum += ms[i] = 1e3 * (now() - t0);
  }
  qsort(ms, (size_t)calls, sizeof(double), cmp);
  printf("  H%-3lld N%-5lld D%-4lld %-9s median %7.3f  p90 %7.3f  max %7.3f  mean %7.3f ms\n",
         (long long)h, (long long)n, (long long)d, causal ? "causal" : "noncausal", ms[calls / 2],
         ms[calls * 9 / 10], ms[calls - 1], sum / calls);
  free(ms);
  free(lse);
  free(q.data), free(k.data), free(v.data), free(o.data);
  free(dO.data), free(dq.data), free(dk.data), free(dv.data);
}

static void shapes(int calls, int threads) {
  shape(1, 64, 256, 1, calls, threads);
  shape(1, 64, 256, 0, calls, threads);
  shape(2, 64, 64, 1, calls, threads);
  shape(1, 256, 64, 1, calls, threads);
  shape(4, 128, 128, 1, calls, threads);
  shape(8, 256, 64, 1, calls, threads);
}

int main(int argc, char **argv) {
  const int calls = argc > 1 ? atoi(argv[1]) : 300, threads = argc > 2 ? atoi(argv[2]) : 2;
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  printf("quiet (%d threads):\n", threads);
  shapes(calls, threads);
  pid_t burners[256];
  int nb = 0;
  for (long c = 0; c < cores && nb < 256; c++) {
    const pid_t pid = fork();
    if (pid == 0)
      for (volatile unsigned long x = 0;; x++) {
      }
    burners[nb++] = pid;
  }
  nanosleep(&(struct timespec){0, 200000000}, NULL);
  printf("busy (%d threads, %d spinning processes):\n", threads, nb);
  shapes(calls, threads);
  for (int i = 0; i < nb; i++) kill(burners[i], SIGKILL);
  for (int i = 0; i < nb; i++) waitpid(burners[i], NULL, 0);
  return 0;
}
