/* fa_fuzz: randomized differential testing of the public API (fuzz.h).
 *
 *   fa_fuzz [--seed S] [--valid N] [--invalid N] [--seconds T] [--bitwise-every K]
 *           [--concurrent T] [--big] [--cuda | --mirror] [--repeat-every K] [-v]
 *   fa_fuzz --case SEED | --invalid-case SEED [--cuda]   (one case, verbose: a repro)
 *   fa_fuzz --case SEED --set KEY=VALUE,...             (that case, some draws replaced)
 *   fa_fuzz --cuda-properties                            (device_cuda.c)
 *
 * Runs N valid and N invalid cases drawn from seeds derived from S (default:
 * from the clock; printed), or as many as fit in T seconds each. Every
 * failing case prints its seed, what it is and the command that runs it
 * alone. --bitwise-every K: every K-th valid case also runs with another
 * thread count and workspace mode, for the same bits. --concurrent T: the
 * cases run on T host threads at once (each checking its own
 * fa_last_error()). --big: one tensor of more than 2^31 elements (skipped
 * when memory is short). --cuda: the tested runs on the GPU (a build with the
 * CUDA backend), the oracle on the CPU; --mirror: the CPU backend through host
 * copies of every buffer, as --cuda drives a device. Exit status 1 on any
 * failure; the closing line is "fa_fuzz: N passed, N failed" (cases). */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fuzz.h"

/* tests/attn.c comes with the suite's runner; only its tolerance functions
 * are used here, so its runner hooks are no-ops. */
void tr_add(const char *name, tr_fn fn, const void *arg, size_t argsize, int slow) {
  (void)name, (void)fn, (void)arg, (void)argsize, (void)slow;
}
void tr_fail(const char *fmt, ...) { (void)fmt; }
void tr_context(const char *fmt, ...) { (void)fmt; }
int tr_verbose(void) { return 0; }
const char *tr_name(void) { return ""; }
double tr_mutate_scale(void) { return 1; }

/* device_cuda.c in a build with the CUDA backend, device_none.c without */
int fz_cuda_init(fz_dev *dev);
int fz_cuda_properties(const fz_dev *dev, uint64_t seed, int verbose);

static double now_s(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct fz_opts {
  uint64_t seed;
  long valid, invalid;
  double seconds;
  int bitwise_every, repeat_every, threads, verbose, cuda;
  const char *prog;
  fz_dev dev;
} fz_opts;

typedef struct fz_tally {
  long valid, invalid, valid_failed, invalid_failed, unsupported, over_cap;
  double worst_ratio;
  long mutation_counts[64];
} fz_tally;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static void report(const fz_opts *o, const char *kind, uint64_t seed, const fz_case *c,
                   const fz_ctx *x, const char *extra) {
  char desc[1024];
  fz_describe(c, desc, sizeof desc);
  pthread_mutex_lock(&g_lock);
  printf("FAIL %s case %#llx%s: %s", kind, (unsigned long long)seed, extra, x->first);
  if (x->failures > 1) printf(" [+%d more]", x->failures - 1);
  printf("\n  case: %s\n  repro: %s %s %#llx%s\n", desc, o->prog,
         !strcmp(kind, "valid") ? "--case" : "--invalid-case", (unsigned long long)seed,
         o->cuda ? " --cuda" : "");
  fflush(stdout);
  pthread_mutex_unlock(&g_lock);
}

/* --set KEY=VALUE,...: a drawn case with some of its draws replaced, to find
 * which part of a failing case matters. Keys: alibi (0/1), alibi_stride,
 * dropout (p), deterministic, threads, std, softcap, causal, plain (a tensor
 * index 0-7 for q k v o do dq dk dv, or 8 for all: its layout becomes
 * contiguous (b, n, h) without gaps). */
static const char *g_set;

static void apply_set(fz_case *c) {
  const char *s = g_set;
  while (s && *s) {
    char key[32];
    double v = 0;
    int used = 0;
    if (sscanf(s, "%31[a-z_]=%lf%n", key, &v, &used) != 2) {
      fprintf(stderr, "fa_fuzz: --set: cannot read \"%s\"\n", s);
      exit(2);
    }
    if (!strcmp(key, "alibi"))
      c->alibi = (int)v;
    else if (!strcmp(key, "alibi_stride"))
      c->alibi_stride = (int64_t)v;
    else if (!strcmp(key, "dropout"))
      c->dropout = (float)v;
    else if (!strcmp(key, "deterministic"))
      c->deterministic = (int)v;
    else if (!strcmp(key, "threads"))
      c->threads = (int)v;
    else if (!strcmp(key, "std"))
      c->qk_std = v;
    else if (!strcmp(key, "softcap"))
      c->softcap = (float)v;
    else if (!strcmp(key, "causal"))
      c->causal = (int)v;
    else if (!strcmp(key, "plain"))
      for (int t = 0; t < FZ_NT; t++) {
        if ((int)v != t && (int)v != FZ_NT) continue;
        memset(&c->lay[t], 0, sizeof c->lay[t]);
        c->lay[t].order[0] = 0, c->lay[t].order[1] = 1, c->lay[t].order[2] = 2;
      }
    else {
      fprintf(stderr, "fa_fuzz: --set: unknown key %s\n", key);
      exit(2);
    }
    s += used;
    if (*s == ',') s++;
  }
}

static int run_valid(const fz_opts *o, const fz_dev *dev, uint64_t seed, int bitwise, fz_tally *t) {
  fz_case c;
  fz_draw(&c, seed, o->cuda);
  apply_set(&c);
  fz_ctx x = {0, "", o->verbose};
  fz_stats st = {0, 0, 0};
  if (o->verbose) {
    char desc[1024];
    fz_describe(&c, desc, sizeof desc);
    printf("valid %#llx: %s\n", (unsigned long long)seed, desc);
  }
  fz_check_valid(&c, dev, bitwise, &x, &st);
  if (o->cuda && o->repeat_every > 0 && seed % (uint64_t)o->repeat_every == 0)
    fz_check_repeat(&c, dev, &x);
  t->valid++;
  t->unsupported += st.unsupported;
  t->over_cap += st.naive_over_cap != 0;
  if (st.worst_ratio > t->worst_ratio) t->worst_ratio = st.worst_ratio;
  if (x.failures) {
    t->valid_failed++;
    report(o, "valid", seed, &c, &x, "");
  }
  return x.failures;
}

static int run_invalid(const fz_opts *o, const fz_dev *dev, uint64_t seed, fz_tally *t) {
  fz_case c;
  fz_draw(&c, seed, o->cuda);
  int m = (int)(fz_mix(seed, 1) % (uint64_t)fz_num_mutations());
  fz_ctx x = {0, "", o->verbose};
  if (o->verbose) {
    char desc[1024];
    fz_describe(&c, desc, sizeof desc);
    printf("invalid %#llx: %s\n", (unsigned long long)seed, desc);
  }
  m = fz_check_invalid(&c, m, dev, &x);
  t->invalid++;
  t->mutation_counts[m % 64]++;
  if (x.failures) {
    char extra[96];
    snprintf(extra, sizeof extra, " (mutation %s)", fz_mutation_name(m));
    t->invalid_failed++;
    report(o, "invalid", seed, &c, &x, extra);
  }
  return x.failures;
}

/* One host thread's share: cases i = first, first + step, ... */
typedef struct fz_worker {
  const fz_opts *o;
  int first, step;
  double t_end;
  fz_tally valid_t, invalid_t;
  int msg_failures;
} fz_worker;

/* Between cases a worker sets messages only it can have made (a pass value of
 * its own) and checks each is still there after a valid call, while the other
 * workers do the same: fa_last_error() is per thread. */
static void own_message(fz_worker *w, long i) {
  fa_params p;
  memset(&p, 0, sizeof p);
  float buf[8] = {0};
  fa_tensor q = fa_tensor_bnhd(buf, FA_DTYPE_F32, 1, 1, 1, 8);
  size_t bytes;
  for (int round = 0; round < 64; round++) {
    const int pass = 100000 + w->first * 10000 + (int)((i * 64 + round) % 10000);
    char want[64];
    snprintf(want, sizeof want, "pass: unknown pass %d", pass);
    (void)fa_workspace_size((fa_pass)pass, &p, &q, &q, &q, &bytes);
    (void)fa_workspace_size(FA_PASS_FORWARD, &p, &q, &q, &q, &bytes); /* valid: no message */
    if (strcmp(fa_last_error(), want) != 0) {
      pthread_mutex_lock(&g_lock);
      printf("FAIL concurrent: thread %d's fa_last_error() is \"%s\", not its own \"%s\"\n",
             w->first, fa_last_error(), want);
      pthread_mutex_unlock(&g_lock);
      w->msg_failures++;
      break;
    }
  }
}

/* The worker's device: its own stream where the device has streams. */
static fz_dev worker_dev(const fz_worker *w) {
  fz_dev dev = w->o->dev;
  if (w->step > 1 && dev.thread_stream) dev.stream = dev.thread_stream();
  return dev;
}

/* Runs the worker's share of the valid cases (or, with invalid, of the invalid ones). */
static void work(fz_worker *w, int invalid) {
  const fz_opts *o = w->o;
  const fz_dev dev = worker_dev(w);
  const long n = invalid ? o->invalid : o->valid;
  for (long i = w->first; i < n || (n == 0 && o->seconds > 0); i += w->step) {
    if (o->seconds > 0 && now_s() > w->t_end) break;
    if (invalid)
      run_invalid(o, &dev, fz_mix(o->seed ^ 0xbb67ae8584caa73bull, (uint64_t)i), &w->invalid_t);
    else
      run_valid(o, &dev, fz_mix(o->seed, (uint64_t)i),
                o->bitwise_every > 0 && i % o->bitwise_every == 0, &w->valid_t);
    if (w->step > 1) own_message(w, i);
  }
}
static void *worker_valid(void *arg) {
  work((fz_worker *)arg, 0);
  return NULL;
}
static void *worker_invalid(void *arg) {
  work((fz_worker *)arg, 1);
  return NULL;
}

static void merge(fz_tally *a, const fz_tally *b) {
  a->valid += b->valid;
  a->invalid += b->invalid;
  a->valid_failed += b->valid_failed;
  a->invalid_failed += b->invalid_failed;
  a->unsupported += b->unsupported;
  a->over_cap += b->over_cap;
  if (b->worst_ratio > a->worst_ratio) a->worst_ratio = b->worst_ratio;
  for (int m = 0; m < 64; m++) a->mutation_counts[m] += b->mutation_counts[m];
}

/* Runs the valid (or invalid) cases on o->threads host threads. */
static int run_phase(const fz_opts *o, int invalid, fz_tally *total, double *secs) {
  const int nt = o->threads > 0 ? o->threads : 1;
  fz_worker w[64];
  pthread_t th[64];
  const double t0 = now_s();
  int msg_failures = 0;
  for (int k = 0; k < nt; k++) {
    memset(&w[k], 0, sizeof w[k]);
    w[k].o = o;
    w[k].first = k;
    w[k].step = nt;
    w[k].t_end = t0 + o->seconds;
  }
  if (nt == 1) {
    (invalid ? worker_invalid : worker_valid)(&w[0]);
  } else {
    for (int k = 0; k < nt; k++)
      if (pthread_create(&th[k], NULL, invalid ? worker_invalid : worker_valid, &w[k]) != 0) {
        fprintf(stderr, "fa_fuzz: pthread_create failed\n");
        exit(2);
      }
    for (int k = 0; k < nt; k++) pthread_join(th[k], NULL);
  }
  for (int k = 0; k < nt; k++) {
    merge(total, invalid ? &w[k].invalid_t : &w[k].valid_t);
    msg_failures += w[k].msg_failures;
  }
  *secs = now_s() - t0;
  return msg_failures;
}

static uint64_t parse_u64(const char *s) { return strtoull(s, NULL, 0); }

static void usage(const char *prog) {
  fprintf(stderr,
          "usage: %s [--seed S] [--valid N] [--invalid N] [--seconds T] [--bitwise-every K]\n"
          "          [--concurrent T] [--big] [--cuda | --mirror] [--repeat-every K] [-v]\n"
          "       %s --case SEED [--set KEY=VALUE,...] | --invalid-case SEED [--cuda]\n"
          "       %s --cuda-properties\n",
          prog, prog, prog);
}

int main(int argc, char **argv) {
  fz_opts o;
  memset(&o, 0, sizeof o);
  o.prog = argv[0];
  o.seed = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull;
  o.bitwise_every = 8;
  o.repeat_every = 16;
  o.threads = 1;
  o.dev = fz_cpu;
  int one_valid = 0, one_invalid = 0, big = 0, props = 0;
  uint64_t one_seed = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const int more = i + 1 < argc;
    if (!strcmp(a, "--seed") && more)
      o.seed = parse_u64(argv[++i]);
    else if (!strcmp(a, "--valid") && more)
      o.valid = atol(argv[++i]);
    else if (!strcmp(a, "--invalid") && more)
      o.invalid = atol(argv[++i]);
    else if (!strcmp(a, "--seconds") && more)
      o.seconds = atof(argv[++i]);
    else if (!strcmp(a, "--bitwise-every") && more)
      o.bitwise_every = atoi(argv[++i]);
    else if (!strcmp(a, "--repeat-every") && more)
      o.repeat_every = atoi(argv[++i]);
    else if (!strcmp(a, "--concurrent") && more)
      o.threads = atoi(argv[++i]);
    else if (!strcmp(a, "--case") && more)
      one_valid = 1, one_seed = parse_u64(argv[++i]);
    else if (!strcmp(a, "--set") && more)
      g_set = argv[++i];
    else if (!strcmp(a, "--invalid-case") && more)
      one_invalid = 1, one_seed = parse_u64(argv[++i]);
    else if (!strcmp(a, "--big"))
      big = 1;
    else if (!strcmp(a, "--cuda"))
      o.cuda = 1;
    else if (!strcmp(a, "--cuda-properties"))
      props = 1;
    else if (!strcmp(a, "--mirror"))
      o.dev = fz_cpu_mirrored;
    else if (!strcmp(a, "-v"))
      o.verbose = 1;
    else {
      usage(argv[0]);
      return 2;
    }
  }
  if (o.threads < 1 || o.threads > 64) {
    fprintf(stderr, "fa_fuzz: --concurrent takes 1 to 64 threads\n");
    return 2;
  }
  if (o.cuda || props) {
    if (!fz_cuda_init(&o.dev)) return 77; /* no device (or no CUDA build): skipped */
    o.cuda = 1;
  }
  fz_tally tv, ti;
  memset(&tv, 0, sizeof tv);
  memset(&ti, 0, sizeof ti);
  if (one_valid || one_invalid) {
    o.verbose = 1;
    int f = one_valid ? run_valid(&o, &o.dev, one_seed, 1, &tv)
                      : run_invalid(&o, &o.dev, one_seed, &ti);
    printf("fa_fuzz: %d passed, %d failed\n", !f, !!f);
    return f ? 1 : 0;
  }
  if (!o.valid && !o.invalid && o.seconds <= 0 && !big && !props) o.valid = o.invalid = 100;
  if (o.valid || o.invalid || o.seconds > 0)
    printf("fa_fuzz: seed %#llx (%s; rerun with --seed %#llx)\n", (unsigned long long)o.seed,
           o.cuda ? "tested on the GPU" : "CPU", (unsigned long long)o.seed);
  fflush(stdout);
  int failed = 0;
  double sv = 0, si = 0;
  if (o.valid || o.seconds > 0) failed += run_phase(&o, 0, &tv, &sv);
  if (o.invalid || o.seconds > 0) failed += run_phase(&o, 1, &ti, &si);
  if (tv.valid)
    printf("valid: %ld cases, %ld failed, %.1f s (%.0f cases/s), worst err/tol %.3f%s\n", tv.valid,
           tv.valid_failed, sv, (double)tv.valid / (sv > 0 ? sv : 1), tv.worst_ratio,
           o.threads > 1 ? ", concurrent" : "");
  if (tv.over_cap) {
    const int too_many = tv.over_cap >= 5 && 100 * tv.over_cap > tv.valid;
    printf("valid: %ld cases with the naive yardstick over its sanity cap (ill-conditioned)%s\n",
           tv.over_cap, too_many ? ": more than 1%, FAIL" : "");
    failed += too_many;
  }
  if (tv.unsupported)
    printf("valid: %ld cases refused as unsupported, as the CUDA backend documents\n",
           tv.unsupported);
  if (ti.invalid) {
    printf("invalid: %ld cases, %ld failed, %.1f s (%.0f cases/s); mutations:", ti.invalid,
           ti.invalid_failed, si, (double)ti.invalid / (si > 0 ? si : 1));
    for (int m = 0; m < fz_num_mutations(); m++)
      printf(" %s %ld", fz_mutation_name(m), ti.mutation_counts[m]);
    printf("\n");
  }
  failed += (int)(tv.valid_failed + ti.invalid_failed);
  /* the closing line counts cases (a --big or --cuda-properties run: one check each) */
  long passed = (tv.valid - tv.valid_failed) + (ti.invalid - ti.invalid_failed);
  if (big) {
    const int f = fz_big(&o.dev, o.verbose);
    failed += f, passed += !f;
  }
  if (props) {
    const int f = fz_cuda_properties(&o.dev, o.seed, o.verbose);
    failed += f, passed += !f;
  }
  printf("fa_fuzz: %ld passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
