/* Command-line parsing for flashattn-bench: one table of flags drives both the
 * parser and --help, so the usage text cannot drift from what is accepted. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#define PROG "flashattn-bench"

const char *bench_impl_name(fa_algorithm a) {
  switch (a) {
    case FA_ALGO_STANDARD:
      return "standard";
    case FA_ALGO_FLASH1:
      return "flash1";
    case FA_ALGO_FLASH2:
      return "flash2";
  }
  return "?";
}

const char *bench_pass_name(bench_pass p) {
  switch (p) {
    case BENCH_FWD:
      return "fwd";
    case BENCH_BWD:
      return "bwd";
    case BENCH_FWDBWD:
      return "fwdbwd";
  }
  return "?";
}

const char *bench_dtype_name(fa_dtype d) {
  switch (d) {
    case FA_DTYPE_F32:
      return "f32";
    case FA_DTYPE_F16:
      return "f16";
    case FA_DTYPE_BF16:
      return "bf16";
    case FA_DTYPE_F64:
      return "f64";
  }
  return "?";
}

const char *bench_device_name(fa_device d) { return d == FA_DEVICE_CUDA ? "cuda" : "cpu"; }

const char *bench_layout_name(bench_layout l) { return l == BENCH_BHND ? "bhnd" : "bnhd"; }

const char *bench_standard_name(bench_standard s) { return s == BENCH_STD_HEAD ? "head" : "batch"; }

/* ---- value parsers: each prints its own message and returns -1 on error ---- */

static int bad_value(const char *flag, const char *val, const char *expected) {
  fprintf(stderr, PROG ": %s: invalid value '%s' (expected %s)\n", flag, val, expected);
  return -1;
}

static int parse_i64(const char *flag, const char *val, int64_t lo, int64_t hi, int64_t *out) {
  char *end;
  errno = 0;
  long long x = strtoll(val, &end, 10);
  if (errno || end == val || *end != '\0' || x < lo || x > hi) {
    char expected[96];
    snprintf(expected, sizeof expected, "an integer in [%lld, %lld]", (long long)lo, (long long)hi);
    return bad_value(flag, val, expected);
  }
  *out = x;
  return 0;
}

static int parse_int(const char *flag, const char *val, int lo, int hi, int *out) {
  int64_t x;
  if (parse_i64(flag, val, lo, hi, &x)) return -1;
  *out = (int)x;
  return 0;
}

/* One word out of a fixed list; returns its index. */
static int parse_word(const char *flag, const char *val, const char *const *words, int n,
                      const char *expected) {
  for (int i = 0; i < n; i++)
    if (strcmp(val, words[i]) == 0) return i;
  return bad_value(flag, val, expected);
}

/* A comma list of words (or 'all'), deduplicated, in the order given. */
static int parse_list(const char *flag, const char *val, const char *const *words, int n,
                      const char *expected, int *out, int *n_out) {
  if (strcmp(val, "all") == 0) {
    for (int i = 0; i < n; i++) out[i] = i;
    *n_out = n;
    return 0;
  }
  int count = 0;
  const char *p = val;
  for (;;) {
    size_t len = strcspn(p, ",");
    int found = -1;
    for (int i = 0; i < n; i++)
      if (strlen(words[i]) == len && strncmp(p, words[i], len) == 0) found = i;
    if (found < 0) return bad_value(flag, val, expected);
    int dup = 0;
    for (int i = 0; i < count; i++) dup |= out[i] == found;
    if (!dup) out[count++] = found;
    if (p[len] == '\0') break;
    p += len + 1;
  }
  *n_out = count;
  return 0;
}

/* ---- the flags ------------------------------------------------------------ */

/* Parse state: what must be resolved after every flag is seen. */
typedef struct parse_state {
  bench_opts *o;
  int dtype_given, repeat_given, max_time_given, pass_given;
} parse_state;

typedef int (*opt_fn)(parse_state *s, const char *flag, const char *val);

static const char *const IMPL_WORDS[] = {"standard", "flash1", "flash2"};
static const fa_algorithm IMPL_ALGOS[] = {FA_ALGO_STANDARD, FA_ALGO_FLASH1, FA_ALGO_FLASH2};
static const char *const PASS_WORDS[] = {"fwd", "bwd", "fwdbwd"};
static const char *const DTYPE_WORDS[] = {"f32", "f16", "bf16"};
static const fa_dtype DTYPES[] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16};

static int opt_device(parse_state *s, const char *flag, const char *val) {
  static const char *const words[] = {"cpu", "cuda"};
  int i = parse_word(flag, val, words, 2, "cpu or cuda");
  if (i < 0) return -1;
  s->o->device = i ? FA_DEVICE_CUDA : FA_DEVICE_CPU;
  return 0;
}

static int opt_impl(parse_state *s, const char *flag, const char *val) {
  int idx[BENCH_MAX_IMPLS];
  if (parse_list(flag, val, IMPL_WORDS, 3, "a comma list of standard, flash1, flash2, or all", idx,
                 &s->o->n_impls))
    return -1;
  for (int i = 0; i < s->o->n_impls; i++) s->o->impls[i] = IMPL_ALGOS[idx[i]];
  return 0;
}

static int opt_pass(parse_state *s, const char *flag, const char *val) {
  int idx[BENCH_MAX_PASSES];
  if (parse_list(flag, val, PASS_WORDS, 3, "a comma list of fwd, bwd, fwdbwd, or all", idx,
                 &s->o->n_passes))
    return -1;
  for (int i = 0; i < s->o->n_passes; i++) s->o->passes[i] = (bench_pass)idx[i];
  s->pass_given = 1;
  return 0;
}

#define SIZE_OPT(fn, field, lo, hi)                                  \
  static int fn(parse_state *s, const char *flag, const char *val) { \
    return parse_i64(flag, val, lo, hi, &s->o->field);               \
  }
SIZE_OPT(opt_batch, batch, 1, INT32_MAX)
SIZE_OPT(opt_heads, heads, 1, INT32_MAX)
SIZE_OPT(opt_kv_heads, kv_heads, 1, INT32_MAX)
SIZE_OPT(opt_seqlen, seqlen, 1, INT32_MAX)
SIZE_OPT(opt_seqlen_k, seqlen_k, 1, INT32_MAX)
SIZE_OPT(opt_kv_used, kv_used, 1, INT32_MAX)
SIZE_OPT(opt_paged, page_size, 1, INT32_MAX)
SIZE_OPT(opt_headdim, headdim, 1, FA_MAX_HEADDIM)
#undef SIZE_OPT

static int opt_dtype(parse_state *s, const char *flag, const char *val) {
  int i = parse_word(flag, val, DTYPE_WORDS, 3, "f32, f16 or bf16");
  if (i < 0) return -1;
  s->o->dtype = DTYPES[i];
  s->dtype_given = 1;
  return 0;
}

/* Switches take no value, or =0/1 (--causal=0 is --no-causal). */
static int switch_value(const char *flag, const char *val, int *out) {
  if (!val) return *out = 1, 0;
  if (strcmp(val, "1") == 0 || strcmp(val, "yes") == 0 || strcmp(val, "true") == 0)
    return *out = 1, 0;
  if (strcmp(val, "0") == 0 || strcmp(val, "no") == 0 || strcmp(val, "false") == 0)
    return *out = 0, 0;
  return bad_value(flag, val, "no value, or =0/=1");
}

static int opt_causal(parse_state *s, const char *flag, const char *val) {
  return switch_value(flag, val, &s->o->causal);
}

static int opt_no_causal(parse_state *s, const char *flag, const char *val) {
  int off;
  if (switch_value(flag, val, &off)) return -1;
  s->o->causal = !off;
  return 0;
}

static int opt_window(parse_state *s, const char *flag, const char *val) {
  const char *comma = strchr(val, ',');
  if (!comma) return bad_value(flag, val, "LEFT,RIGHT, e.g. 256,0 (-1: unlimited)");
  char left[64];
  size_t len = (size_t)(comma - val);
  if (len >= sizeof left) return bad_value(flag, val, "LEFT,RIGHT");
  memcpy(left, val, len);
  left[len] = '\0';
  if (parse_i64(flag, left, -1, INT32_MAX, &s->o->window_left) ||
      parse_i64(flag, comma + 1, -1, INT32_MAX, &s->o->window_right))
    return -1;
  s->o->window_enabled = 1;
  return 0;
}

static int opt_softcap(parse_state *s, const char *flag, const char *val) {
  char *end;
  errno = 0;
  double x = strtod(val, &end);
  if (errno || end == val || *end != '\0' || !isfinite(x) || x < 0 || x > 1e30)
    return bad_value(flag, val, "a number >= 0 (0: off)");
  s->o->softcap = (float)x;
  return 0;
}

static int opt_dropout(parse_state *s, const char *flag, const char *val) {
  char *end;
  errno = 0;
  double x = strtod(val, &end);
  if (errno || end == val || *end != '\0' || !(x >= 0 && x < 1))
    return bad_value(flag, val, "a probability in [0, 1)");
  s->o->dropout = (float)x;
  return 0;
}

/* DENSITY[,BLOCK]: a random block mask keeping that share of each row's key blocks. */
static int opt_block_sparse(parse_state *s, const char *flag, const char *val) {
  char *end;
  errno = 0;
  double x = strtod(val, &end);
  if (errno || end == val || !(x >= 0 && x <= 1) || (*end != '\0' && *end != ','))
    return bad_value(flag, val, "DENSITY in [0, 1], optionally ,BLOCK");
  s->o->block_sparse = 1;
  s->o->block_density = x;
  if (*end == ',' && parse_i64(flag, end + 1, 1, INT32_MAX, &s->o->block_size)) return -1;
  return 0;
}

static int opt_layout(parse_state *s, const char *flag, const char *val) {
  static const char *const words[] = {"bnhd", "bhnd"};
  int i = parse_word(flag, val, words, 2, "bnhd or bhnd");
  if (i < 0) return -1;
  s->o->layout = (bench_layout)i;
  return 0;
}

static int opt_standard(parse_state *s, const char *flag, const char *val) {
  static const char *const words[] = {"batch", "head"};
  int i = parse_word(flag, val, words, 2, "batch or head");
  if (i < 0) return -1;
  s->o->standard = (bench_standard)i;
  return 0;
}

static int opt_repeat(parse_state *s, const char *flag, const char *val) {
  s->repeat_given = 1;
  return parse_int(flag, val, 1, 1000000, &s->o->repeat);
}

static int opt_max_time(parse_state *s, const char *flag, const char *val) {
  char *end;
  errno = 0;
  double x = strtod(val, &end);
  if (errno || end == val || *end != '\0' || !isfinite(x) || x < 0)
    return bad_value(flag, val, "a number of seconds >= 0 (0: no limit)");
  s->o->max_time = x;
  s->max_time_given = 1;
  return 0;
}

static int opt_warmup(parse_state *s, const char *flag, const char *val) {
  return parse_int(flag, val, 0, 1000000, &s->o->warmup);
}

static int opt_threads(parse_state *s, const char *flag, const char *val) {
  return parse_int(flag, val, 0, 4096, &s->o->threads);
}

static int opt_seed(parse_state *s, const char *flag, const char *val) {
  int64_t x;
  if (parse_i64(flag, val, 0, INT64_MAX, &x)) return -1;
  s->o->seed = (uint64_t)x;
  return 0;
}

static int opt_append(parse_state *s, const char *flag, const char *val) {
  return switch_value(flag, val, &s->o->append);
}

static int opt_rotary(parse_state *s, const char *flag, const char *val) {
  return switch_value(flag, val, &s->o->rotary);
}

static int opt_json(parse_state *s, const char *flag, const char *val) {
  return switch_value(flag, val, &s->o->json);
}

static int opt_peak(parse_state *s, const char *flag, const char *val) {
  return switch_value(flag, val, &s->o->peak);
}

static int opt_peak_only(parse_state *s, const char *flag, const char *val) {
  if (switch_value(flag, val, &s->o->peak_only)) return -1;
  s->o->peak |= s->o->peak_only;
  return 0;
}

typedef enum opt_kind { TAKES_VALUE, SWITCH, ACTION } opt_kind;

typedef struct opt_def {
  const char *name;
  const char *metavar; /* for TAKES_VALUE */
  opt_kind kind;
  opt_fn fn;
  const char *help;
} opt_def;

static const opt_def OPTS[] = {
    {"--device", "cpu|cuda", TAKES_VALUE, opt_device, "device to run on (default: cpu)"},
    {"--impl", "LIST", TAKES_VALUE, opt_impl,
     "algorithms, comma separated: standard, flash1,\nflash2, or all (default: all)"},
    {"--pass", "LIST", TAKES_VALUE, opt_pass,
     "passes, comma separated: fwd, bwd (the backward\nalone, after an untimed forward), fwdbwd, "
     "or all\n"
     "(default: fwd,bwd)"},
    {"--batch", "N", TAKES_VALUE, opt_batch, "batch size B (default: 32)"},
    {"--heads", "N", TAKES_VALUE, opt_heads, "query heads H (default: 16)"},
    {"--kv-heads", "N", TAKES_VALUE, opt_kv_heads,
     "key/value heads Hk, a divisor of H: GQA/MQA\n(default: H)"},
    {"--seqlen", "N", TAKES_VALUE, opt_seqlen, "query sequence length Nq (default: 512)"},
    {"--seqlen-k", "N", TAKES_VALUE, opt_seqlen_k, "key sequence length Nk (default: Nq)"},
    {"--kv-used", "N", TAKES_VALUE, opt_kv_used,
     "K/V is a cache of Nk rows of which each sequence uses the first N (params.seqused_k); "
     "FLOP/s count N keys"},
    {"--paged", "PAGE_SIZE", TAKES_VALUE, opt_paged,
     "K/V as pools of pages of PAGE_SIZE rows, each\nsequence's pages in random order through "
     "a block\ntable (params.block_table; forward only)"},
    {"--append", NULL, SWITCH, opt_append,
     "the KV-cache call (fa_forward_kvcache): each\nsequence's Nq new keys and values are "
     "written\ninto its cache, then attended to with the\nrest (forward only)"},
    {"--rotary", NULL, SWITCH, opt_rotary,
     "--append with rotary embedding of q and the new\nkeys (rotary_dim = D)"},
    {"--headdim", "N", TAKES_VALUE, opt_headdim, "head dimension D (default: 64)"},
    {"--dtype", "f32|f16|bf16", TAKES_VALUE, opt_dtype,
     "storage type (default: f32 on cpu, f16 on cuda)"},
    {"--causal", NULL, SWITCH, opt_causal, "causal mask, bottom-right aligned (default: on)"},
    {"--no-causal", NULL, SWITCH, opt_no_causal, "no causal mask"},
    {"--window", "LEFT,RIGHT", TAKES_VALUE, opt_window,
     "sliding window; -1 is unlimited on that side\n(default: off)"},
    {"--softcap", "X", TAKES_VALUE, opt_softcap, "logit soft-capping, 0 is off (default: 0)"},
    {"--dropout", "P", TAKES_VALUE, opt_dropout, "dropout probability (default: 0)"},
    {"--block-sparse", "S[,BLOCK]", TAKES_VALUE, opt_block_sparse,
     "random block mask keeping a share S of each\nrow's BLOCK x BLOCK blocks (default BLOCK "
     "128);\n"
     "FLOPs are still counted dense (default: off)"},
    {"--layout", "bnhd|bhnd", TAKES_VALUE, opt_layout,
     "(B,N,H,D) as flash-attn or (B,H,N,D) as PyTorch\nSDPA (default: bnhd)"},
    {"--standard", "batch|head", TAKES_VALUE, opt_standard,
     "what standard attention materialises: S and P\nof the whole batch in one call, as the "
     "papers'\nbaseline, or of one (batch, K/V head) per call,\nthe calls spread over the "
     "threads (default:\nbatch)"},
    {"--repeat", "N", TAKES_VALUE, opt_repeat,
     "timed runs per case; the median is reported\n(default: 3 on cpu, 20 on cuda)"},
    {"--warmup", "N", TAKES_VALUE, opt_warmup, "untimed runs before timing (default: 1)"},
    {"--max-time", "SECONDS", TAKES_VALUE, opt_max_time,
     "a case stops early once its runs took this long,\nafter one timed run; a warmup run that "
     "alone\n"
     "takes longer counts as that run; 0: always run\n--warmup + --repeat (default: 2 on cpu, 10 "
     "on cuda)"},
    {"--threads", "N", TAKES_VALUE, opt_threads, "CPU threads, 0 for all cores (default: 0)"},
    {"--seed", "N", TAKES_VALUE, opt_seed, "random seed of the inputs (default: 1)"},
    {"--json", NULL, SWITCH, opt_json,
     "one JSON object per line (records: case, peak,\nsummary) instead of the table"},
    {"--peak", NULL, SWITCH, opt_peak,
     "first measure the CPU's float32 FMA peak and DRAM\nread bandwidth, then show each case's "
     "GFLOP/s\n"
     "as a share of that peak (peak%)"},
    {"--peak-only", NULL, SWITCH, opt_peak_only, "measure the peak and bandwidth, run no cases"},
    {"--help", NULL, ACTION, NULL, "this text"},
    {"--version", NULL, ACTION, NULL, "the library version"},
};
enum { N_OPTS = sizeof OPTS / sizeof OPTS[0] };

static void usage(FILE *f) {
  fprintf(f, "usage: " PROG
             " [options]\n"
             "\n"
             "Times standard attention, FlashAttention-1 and FlashAttention-2 through the\n"
             "flashattn C API and prints time, GFLOP/s and extra memory side by side.\n"
             "Without options it runs the seeds' comparison: B=32, Nq=Nk=512, H=16, D=64,\n"
             "causal, f32 on the CPU, all three algorithms, forward and backward.\n"
             "\n"
             "options (--flag VALUE or --flag=VALUE):\n");
  for (int i = 0; i < N_OPTS; i++) {
    char head[64];
    snprintf(head, sizeof head, "%s%s%s", OPTS[i].name, OPTS[i].metavar ? " " : "",
             OPTS[i].metavar ? OPTS[i].metavar : "");
    /* continuation lines of the help text are indented under the first */
    const char *h = OPTS[i].help;
    fprintf(f, "  %-24s ", head);
    for (; *h; h++) {
      fputc(*h, f);
      if (*h == '\n') fprintf(f, "  %-24s ", "");
    }
    fputc('\n', f);
  }
  fprintf(f,
          "\n"
          "FLOPs as in the papers: forward 4*B*H*Nq*Nk*D, halved when causal (the\n"
          "exact count of visible pairs with --window, or causal with Nq != Nk);\n"
          "backward 2.5x and fwdbwd 3.5x the forward.\n"
          "Extra memory is the workspace fa_workspace_size() asks for (the bench passes it\n"
          "in); a case that would not fit in 75%% of RAM is reported as OOM.\n"
          "Exit status: 0 ok (OOM and unsupported cases included), 1 a case failed or the\n"
          "device is unavailable, 2 bad command line.\n");
}

static const opt_def *find_opt(const char *name, size_t len) {
  for (int i = 0; i < N_OPTS; i++)
    if (strlen(OPTS[i].name) == len && strncmp(OPTS[i].name, name, len) == 0) return &OPTS[i];
  return NULL;
}

static int usage_error(void) {
  fprintf(stderr, "Try '" PROG " --help'.\n");
  return 2;
}

static void set_defaults(bench_opts *o) {
  memset(o, 0, sizeof *o);
  o->device = FA_DEVICE_CPU;
  o->n_impls = 3;
  o->impls[0] = FA_ALGO_STANDARD, o->impls[1] = FA_ALGO_FLASH1, o->impls[2] = FA_ALGO_FLASH2;
  o->n_passes = 2;
  o->passes[0] = BENCH_FWD, o->passes[1] = BENCH_BWD;
  o->batch = 32, o->heads = 16, o->seqlen = 512, o->headdim = 64;
  o->causal = 1;
  o->window_left = o->window_right = -1;
  o->block_size = 128;
  o->warmup = 1;
  o->seed = 1;
}

/* Defaults that depend on other flags, and checks across flags. */
static int resolve(parse_state *s) {
  bench_opts *o = s->o;
  if (!o->kv_heads) o->kv_heads = o->heads;
  if (!o->seqlen_k) o->seqlen_k = o->seqlen;
  if (o->kv_used > o->seqlen_k) {
    fprintf(stderr, PROG ": --kv-used %lld exceeds --seqlen-k %lld\n", (long long)o->kv_used,
            (long long)o->seqlen_k);
    return -1;
  }
  if (o->rotary) o->append = 1;
  const int64_t used = o->kv_used ? o->kv_used : o->seqlen_k;
  if (o->append && o->seqlen > used) {
    fprintf(stderr, PROG ": --append: the %lld new rows (--seqlen) exceed the %lld keys attended\n",
            (long long)o->seqlen, (long long)used);
    return -1;
  }
  if ((o->page_size || o->append) && !s->pass_given) o->n_passes = 1, o->passes[0] = BENCH_FWD;
  if (o->page_size || o->append)
    for (int i = 0; i < o->n_passes; i++)
      if (o->passes[i] != BENCH_FWD) {
        fprintf(stderr, PROG ": --paged and --append time the forward only (--pass fwd)\n");
        return -1;
      }
  if (o->heads % o->kv_heads) {
    fprintf(stderr, PROG ": --kv-heads %lld must divide --heads %lld\n", (long long)o->kv_heads,
            (long long)o->heads);
    return -1;
  }
  if (!s->dtype_given) o->dtype = o->device == FA_DEVICE_CUDA ? FA_DTYPE_F16 : FA_DTYPE_F32;
  if (!s->repeat_given) o->repeat = o->device == FA_DEVICE_CUDA ? 20 : 3;
  if (!s->max_time_given) o->max_time = o->device == FA_DEVICE_CUDA ? 10 : 2;
  if (o->threads == 0) o->threads = omp_get_num_procs();
  if (o->threads < 1) o->threads = 1;
  return 0;
}

int bench_parse_args(int argc, char **argv, bench_opts *o) {
  parse_state s = {o, 0, 0, 0, 0};
  set_defaults(o);
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    const char *eq = strchr(arg, '=');
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    const opt_def *d = strncmp(arg, "--", 2) == 0 ? find_opt(arg, len) : NULL;
    if (!d) {
      fprintf(stderr, PROG ": %s '%s'\n", arg[0] == '-' ? "unknown option" : "unexpected argument",
              arg);
      return usage_error();
    }
    const char *val = eq ? eq + 1 : NULL;
    if (d->kind == ACTION) {
      if (val) return fprintf(stderr, PROG ": %s takes no value\n", d->name), usage_error();
      if (strcmp(d->name, "--help") == 0)
        usage(stdout);
      else
        printf("flashattn %s\n", fa_version());
      return 0;
    }
    if (d->kind == TAKES_VALUE && !val) {
      if (i + 1 >= argc) {
        fprintf(stderr, PROG ": %s needs a value (%s)\n", d->name, d->metavar);
        return usage_error();
      }
      val = argv[++i];
    }
    if (d->fn(&s, d->name, val)) return usage_error();
  }
  return resolve(&s) ? usage_error() : -1;
}
