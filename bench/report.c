/* Output of flashattn-bench: a table for people, one JSON object per line for
 * scripts, and the comparison against standard attention measured in the run. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <string.h>

#include "bench.h"

static const double MIB = 1024.0 * 1024.0;

/* Query/key pairs that survive the masks, summed over the query rows. Causal
 * with Nq == Nk counts half the square, as the papers do; otherwise (windows,
 * causal with Nq != Nk: bottom-right aligned) the exact count. */
static double visible_pairs(const bench_opts *o) {
  const int64_t nq = o->seqlen, nk = o->kv_used ? o->kv_used : o->seqlen_k;
  if (!o->window_enabled && (!o->causal || nq == nk))
    return o->causal ? 0.5 * (double)nq * (double)nk : (double)nq * (double)nk;
  double pairs = 0;
  for (int64_t i = 0; i < nq; i++) {
    const int64_t diag = i + nk - nq; /* bottom-right aligned */
    int64_t lo = o->window_left >= 0 ? diag - o->window_left : 0;
    int64_t hi = o->window_right >= 0 ? diag + o->window_right : nk - 1;
    if (o->causal && hi > diag) hi = diag;
    if (lo < 0) lo = 0;
    if (hi > nk - 1) hi = nk - 1;
    if (hi >= lo) pairs += (double)(hi - lo + 1);
  }
  return pairs;
}

double bench_flops(const bench_opts *o, bench_pass pass) {
  static const double factor[] = {1.0, 2.5, 3.5}; /* fwd, bwd, fwdbwd */
  return 4.0 * (double)o->headdim * (double)o->batch * (double)o->heads * visible_pairs(o) *
         factor[pass];
}

static const char *status_name(bench_status s) {
  switch (s) {
    case BENCH_OK:
      return "ok";
    case BENCH_OOM:
      return "oom";
    case BENCH_UNSUPPORTED:
      return "unsupported";
    case BENCH_ERROR:
      return "error";
  }
  return "?";
}

static int show_peak(const bench_opts *o, const bench_peak *peak) {
  return peak && peak->measured && o->device == FA_DEVICE_CPU;
}

/* ---- JSON ------------------------------------------------------------------ */

static void json_string(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\')
      printf("\\%c", c);
    else if (c < 0x20)
      printf("\\u%04x", c);
    else
      putchar(c);
  }
  putchar('"');
}

static void json_number(double x) {
  if (isfinite(x))
    printf("%.6g", x);
  else
    printf("null");
}

static void json_result(const bench_opts *o, const bench_peak *peak, const bench_result *r) {
  const int ok = r->status == BENCH_OK;
  printf("{\"record\":\"case\",\"impl\":\"%s\",\"device\":\"%s\",\"pass\":\"%s\"",
         bench_impl_name(r->impl), bench_device_name(o->device), bench_pass_name(r->pass));
  printf(",\"B\":%lld,\"H\":%lld,\"Hk\":%lld,\"Nq\":%lld,\"Nk\":%lld,\"D\":%lld",
         (long long)o->batch, (long long)o->heads, (long long)o->kv_heads, (long long)o->seqlen,
         (long long)o->seqlen_k, (long long)o->headdim);
  printf(",\"dtype\":\"%s\",\"layout\":\"%s\",\"causal\":%s", bench_dtype_name(o->dtype),
         bench_layout_name(o->layout), o->causal ? "true" : "false");
  if (o->window_enabled)
    printf(",\"window_left\":%lld,\"window_right\":%lld", (long long)o->window_left,
           (long long)o->window_right);
  else
    printf(",\"window_left\":null,\"window_right\":null");
  printf(",\"softcap\":");
  json_number(o->softcap);
  printf(",\"dropout\":");
  json_number(o->dropout);
  printf(",\"block_density\":");
  json_number(o->block_density);
  printf(",\"block_size\":%lld", (long long)(o->block_sparse ? o->block_size : 0));
  printf(",\"kv_used\":%lld", (long long)o->kv_used);
  if (r->impl == FA_ALGO_STANDARD) printf(",\"standard\":\"%s\"", bench_standard_name(o->standard));
  printf(",\"paged\":%lld,\"append\":%d,\"rotary\":%d", (long long)o->page_size, o->append,
         o->rotary);
  printf(",\"status\":\"%s\",\"ms\":", status_name(r->status));
  json_number(ok ? r->ms : NAN);
  printf(",\"ms_min\":");
  json_number(ok ? r->ms_min : NAN);
  printf(",\"flops\":%.0f,\"gflops\":", r->flops);
  json_number(ok ? r->gflops : NAN);
  if (show_peak(o, peak)) {
    printf(",\"peak_gflops\":");
    json_number(peak->fma_gflops);
    printf(",\"peak_fraction\":");
    json_number(ok ? r->gflops / peak->fma_gflops : NAN);
  }
  printf(",\"extra_bytes\":");
  if (r->extra_known)
    printf("%zu", r->extra_bytes);
  else
    printf("null");
  printf(",\"threads\":%d,\"runs\":%d,\"repeat\":%d,\"warmup\":%d,\"max_time\":%g,\"seed\":%llu",
         o->device == FA_DEVICE_CPU ? o->threads : 0, r->runs, o->repeat, o->warmup, o->max_time,
         (unsigned long long)o->seed);
  if (r->message[0]) {
    printf(",\"error\":");
    json_string(r->message);
  }
  printf(",\"version\":\"%s\"}\n", fa_version());
}

/* ---- table ----------------------------------------------------------------- */

void bench_print_header(const bench_opts *o, const bench_peak *peak) {
  if (o->json) return;
  printf("flashattn %s bench: %s", fa_version(), bench_device_name(o->device));
  if (o->device == FA_DEVICE_CPU) printf(", %d thread%s", o->threads, o->threads == 1 ? "" : "s");
  printf(", layout %s", bench_layout_name(o->layout));
  if (o->window_enabled)
    printf(", window (%lld, %lld)", (long long)o->window_left, (long long)o->window_right);
  if (o->softcap > 0) printf(", softcap %g", o->softcap);
  if (o->dropout > 0) printf(", dropout %g", o->dropout);
  if (o->kv_used) printf(", KV cache: %lld of its keys used", (long long)o->kv_used);
  if (o->page_size) printf(", paged: %lld rows a page", (long long)o->page_size);
  if (o->append)
    printf(", KV-cache call: %lld new rows appended%s", (long long)o->seqlen,
           o->rotary ? " and rotated" : "");
  if (o->block_sparse)
    printf(", block-sparse %g of %lldx%lld blocks", o->block_density, (long long)o->block_size,
           (long long)o->block_size);
  printf(", median of %d run%s after %d warmup", o->repeat, o->repeat == 1 ? "" : "s", o->warmup);
  if (o->max_time > 0) printf(" (fewer past %gs a case)", o->max_time);
  printf("\n");
  for (int i = 0; i < o->n_impls; i++)
    if (o->impls[i] == FA_ALGO_STANDARD)
      printf(o->standard == BENCH_STD_BATCH
                 ? "standard: S and P of the whole batch in memory (B*H*Nq*Nk floats each), the "
                   "papers' baseline (--standard head: one head at a time)\n"
                 : "standard: one call per (batch, K/V head), on one thread each, S and P of "
                   "the heads in progress alone in memory (--standard batch: the whole batch, "
                   "the papers' baseline)\n");
  printf("%-9s %-6s %-6s %4s %4s %4s %6s %6s %4s %-5s %-6s %11s %4s %9s %10s", "impl", "device",
         "pass", "B", "H", "Hk", "Nq", "Nk", "D", "dtype", "causal", "ms(median)", "runs",
         "GFLOP/s", "extra MiB");
  if (show_peak(o, peak)) printf(" %6s", "peak%");
  printf("\n");
  fflush(stdout);
}

void bench_print_peak(const bench_opts *o, const bench_peak *peak) {
  if (o->json) {
    printf(
        "{\"record\":\"peak\",\"device\":\"cpu\",\"threads\":%d,\"isa\":\"%s\","
        "\"fma_gflops\":%.6g,\"dram_read_gbps\":%.6g,\"dram_bytes\":%zu}\n",
        o->threads, peak->isa, peak->fma_gflops, peak->dram_gbps, peak->dram_bytes);
  } else {
    printf(
        "peak (cpu, %d thread%s): float32 FMA %.1f GFLOP/s (%s), DRAM read %.1f GB/s "
        "(%.0f MiB array)\n",
        o->threads, o->threads == 1 ? "" : "s", peak->fma_gflops, peak->isa, peak->dram_gbps,
        (double)peak->dram_bytes / MIB);
  }
  fflush(stdout);
}

void bench_print_result(const bench_opts *o, const bench_peak *peak, const bench_result *r) {
  if (o->json) {
    json_result(o, peak, r);
    fflush(stdout);
    return;
  }
  printf("%-9s %-6s %-6s %4lld %4lld %4lld %6lld %6lld %4lld %-5s %-6s", bench_impl_name(r->impl),
         bench_device_name(o->device), bench_pass_name(r->pass), (long long)o->batch,
         (long long)o->heads, (long long)o->kv_heads, (long long)o->seqlen, (long long)o->seqlen_k,
         (long long)o->headdim, bench_dtype_name(o->dtype), o->causal ? "yes" : "no");
  if (r->status == BENCH_OK) {
    printf(" %11.3f %4d %9.2f %10.3f", r->ms, r->runs, r->gflops, (double)r->extra_bytes / MIB);
    if (show_peak(o, peak)) printf(" %5.1f%%", 100.0 * r->gflops / peak->fma_gflops);
  } else if (r->status == BENCH_OOM && r->extra_known) {
    printf(" %11s %4s %9s %10.1f", "OOM", "-", "-", (double)r->extra_bytes / MIB);
  } else if (r->status == BENCH_OOM) {
    printf(" %11s %4s %9s %10s", "OOM", "-", "-", "-");
  } else {
    printf(" %11s %4s %9s %10s", r->status == BENCH_UNSUPPORTED ? "unsupported" : "ERROR", "-", "-",
           "-");
  }
  printf("\n");
  fflush(stdout);
}

/* ---- comparison ------------------------------------------------------------- */

static const bench_result *find_result(const bench_result *rs, int n, fa_algorithm impl,
                                       bench_pass pass) {
  for (int i = 0; i < n; i++)
    if (rs[i].impl == impl && rs[i].pass == pass) return &rs[i];
  return NULL;
}

/* r against standard (base), which ran or was OOM: speed and extra-memory ratios. */
static void summary_line(const bench_opts *o, const bench_result *base, const bench_result *r) {
  const double speedup = base->status == BENCH_OK ? base->ms / r->ms : NAN;
  /* how many times less extra memory than standard (null in JSON when r needs none) */
  const double mem_ratio =
      r->extra_bytes ? (double)base->extra_bytes / (double)r->extra_bytes : INFINITY;
  if (o->json) {
    printf(
        "{\"record\":\"summary\",\"impl\":\"%s\",\"baseline\":\"standard\",\"standard\":\"%s\","
        "\"pass\":\"%s\",\"baseline_status\":\"%s\",\"speedup\":",
        bench_impl_name(r->impl), bench_standard_name(o->standard), bench_pass_name(r->pass),
        status_name(base->status));
    json_number(speedup);
    printf(",\"extra_bytes\":%zu,\"baseline_extra_bytes\":%zu,\"memory_ratio\":", r->extra_bytes,
           base->extra_bytes);
    json_number(mem_ratio);
    printf("}\n");
    return;
  }
  printf("%s vs standard (%s), %-6s: ", bench_impl_name(r->impl),
         o->standard == BENCH_STD_HEAD ? "per head" : "whole batch", bench_pass_name(r->pass));
  if (base->status == BENCH_OK)
    printf("speedup %5.2fx, ", speedup);
  else
    printf("standard OOM, ");
  if (r->extra_bytes == 0 || base->extra_bytes == 0)
    printf("extra memory %.3f MiB vs %.3f MiB\n", (double)r->extra_bytes / MIB,
           (double)base->extra_bytes / MIB);
  else
    printf("extra memory %.1fx %s (%.3f MiB vs %.3f MiB)\n",
           mem_ratio >= 1 ? mem_ratio : 1 / mem_ratio, mem_ratio >= 1 ? "smaller" : "larger",
           (double)r->extra_bytes / MIB, (double)base->extra_bytes / MIB);
}

void bench_print_summary(const bench_opts *o, const bench_result *rs, int n) {
  int printed = 0;
  for (int p = 0; p < o->n_passes; p++) {
    const bench_result *base = find_result(rs, n, FA_ALGO_STANDARD, o->passes[p]);
    if (!base || !(base->status == BENCH_OK || (base->status == BENCH_OOM && base->extra_known)))
      continue;
    for (int i = 0; i < o->n_impls; i++) {
      const bench_result *r = find_result(rs, n, o->impls[i], o->passes[p]);
      if (!r || r->impl == FA_ALGO_STANDARD || r->status != BENCH_OK) continue;
      if (!printed && !o->json) printf("\n");
      summary_line(o, base, r);
      printed = 1;
    }
  }
  fflush(stdout);
}
