/* The deterministic backward's dQ order (src/common/dq_order.h), on the CPU:
 * for many masks and sizes, (1) fa_dq_block_tiles is the kernels' query-tile
 * range (every row of a tile it names sees a key of the block, checked row by
 * row against fa_mask_row_range); (2) at every query tile the turns of the
 * blocks that visit it are 0, 1, ..., count - 1 (each block has its own, so
 * the sum has one order); (3) a simulation of the kernel's waits, with as few
 * blocks resident at once as the order allows (one for banded masks, one wave
 * for full ones) taken in launch order, runs to the end: no block waits for
 * one that cannot run. Internal: it includes the library's source headers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dq_order.h"

static int g_fail, g_cases;

#define CHECK(cond, ...)            \
  do {                              \
    if (!(cond)) {                  \
      if (g_fail++ < 10) {          \
        printf("FAIL ");            \
        printf(__VA_ARGS__);        \
        printf("\n");               \
      }                             \
      return;                       \
    }                               \
  } while (0)

/* Does some row of query tile m see some key of block x (brute force)? */
static int sees(const fa_mask *mk, int x, int m, int bc, int br) {
  for (int64_t i = (int64_t)m * br; i < (int64_t)(m + 1) * br && i < mk->nq; i++) {
    int64_t lo, hi;
    fa_mask_row_range(mk, i, &lo, &hi);
    if (lo < (int64_t)(x + 1) * bc && hi > (int64_t)x * bc && lo < hi) return 1;
  }
  return 0;
}

static void check_one(int nq, int nk, int causal, int win, int64_t wl, int64_t wr, int bc, int br,
                      int wave, int heads) {
  g_cases++;
  const fa_mask mk = fa_mask_make(nq, nk, causal, win, wl, wr);
  const fa_dq_order o = fa_dq_order_make(&mk, bc, br, wave);
  const int nb = o.nblocks, mt = o.mtiles, banded = fa_dq_banded(&mk);
  int *mb = malloc(sizeof(int) * (size_t)(nb + 1)), *nm = malloc(sizeof(int) * (size_t)(nb + 1));
  int *cnt = calloc((size_t)mt + 1, sizeof(int));
  char *seen = calloc((size_t)(mt + 1) * (nb + 1), 1);
  for (int x = 0; x < nb; x++) {
    fa_dq_block_tiles(&mk, x, bc, br, &mb[x], &nm[x]);
    for (int m = 0; m < mt; m++) {
      const int in = m >= mb[x] && m < mb[x] + nm[x];
      /* (1): the range is exactly the tiles that see the block, or (full
       * masks) all of them */
      CHECK(in == sees(&mk, x, m, bc, br),
            "tiles nq=%d nk=%d causal=%d win=%d(%lld,%lld) bc=%d br=%d x=%d m=%d: range %d+%d",
            nq, nk, causal, win, (long long)wl, (long long)wr, bc, br, x, m, mb[x], nm[x]);
      if (!banded) CHECK(mb[x] == 0 && nm[x] == mt, "full mask: block %d sees tiles %d+%d", x,
                         mb[x], nm[x]);
      if (!in) continue;
      const int t = fa_dq_turn(&o, x, m);
      CHECK(t >= 0 && t < nb && !seen[(size_t)m * nb + t],
            "turn nq=%d nk=%d causal=%d win=%d(%lld,%lld) bc=%d br=%d wave=%d x=%d m=%d: %d", nq,
            nk, causal, win, (long long)wl, (long long)wr, bc, br, wave, x, m, t);
      seen[(size_t)m * nb + t] = 1;
      cnt[m]++;
    }
  }
  /* (2): turns 0 .. cnt - 1 at every tile */
  for (int m = 0; m < mt; m++)
    for (int t = 0; t < cnt[m]; t++)
      CHECK(seen[(size_t)m * nb + t], "tile %d: turn %d missing of %d", m, t, cnt[m]);
  /* (3): the kernel's walk. Block x's steps: head after head, its tiles from
   * m_begin + rot on; a step waits for sem[head][m] == turn. At most `res`
   * blocks run at once, taken in launch order. */
  const int res = banded ? 1 : (wave < nb ? wave : nb);
  int *sem = calloc((size_t)heads * (mt + 1), sizeof(int)), *pos = calloc((size_t)nb + 1, sizeof(int));
  int next = 0, running = 0, done = 0, *run = calloc((size_t)nb + 1, sizeof(int));
  while (done < nb) {
    while (running < res && next < nb) run[running++] = fa_dq_block_of(banded, nb, next++);
    int progress = 0;
    for (int k = 0; k < running; k++) {
      const int x = run[k], steps = nm[x] * heads;
      if (pos[x] < steps) {
        const int h = pos[x] / nm[x], p = pos[x] % nm[x];
        const int m = mb[x] + (p + fa_dq_rot(&o, x, nm[x])) % nm[x];
        if (sem[h * mt + m] == fa_dq_turn(&o, x, m)) {
          sem[h * mt + m]++;
          pos[x]++;
          progress = 1;
        }
      }
      if (pos[x] >= steps) {
        run[k--] = run[--running];
        done++;
        progress = 1;
      }
    }
    CHECK(progress, "deadlock nq=%d nk=%d causal=%d win=%d(%lld,%lld) bc=%d br=%d wave=%d heads=%d",
          nq, nk, causal, win, (long long)wl, (long long)wr, bc, br, wave, heads);
  }
  for (int m = 0; m < mt; m++)
    for (int h = 0; h < heads; h++)
      CHECK(sem[h * mt + m] == cnt[m], "tile %d head %d: %d adds of %d", m, h, sem[h * mt + m],
            cnt[m]);
  free(mb), free(nm), free(cnt), free(seen), free(sem), free(pos), free(run);
}

int main(void) {
  const int sizes[] = {1, 2, 5, 63, 64, 65, 100, 128, 129, 200, 300, 513, 700};
  const int ns = (int)(sizeof sizes / sizeof *sizes);
  const int tiles[3][2] = {{128, 128}, {128, 64}, {64, 64}}; /* (bc, br) of D = 64, 128, 256 */
  const int64_t wins[][2] = {{-1, -1}, {-1, 0}, {0, 0}, {50, 10}, {300, -1}, {7, 130}, {-1, 40}};
  for (int a = 0; a < ns; a++)
    for (int c = 0; c < ns; c++)
      for (int t = 0; t < 3; t++) {
        const int nq = sizes[a], nk = sizes[c], bc = tiles[t][0], br = tiles[t][1];
        check_one(nq, nk, 0, 0, 0, 0, bc, br, 132, 1);
        check_one(nq, nk, 0, 0, 0, 0, bc, br, 3, 2); /* waves smaller than the blocks */
        check_one(nq, nk, 1, 0, 0, 0, bc, br, 132, 2);
        for (int w = 0; w < (int)(sizeof wins / sizeof *wins); w++)
          check_one(nq, nk, w & 1, 1, wins[w][0], wins[w][1], bc, br, 5, 1 + (w & 1));
      }
  /* small tiles: many blocks and tiles, every wave size */
  for (int nq = 1; nq <= 40; nq += 3)
    for (int nk = 1; nk <= 40; nk += 3)
      for (int wave = 1; wave <= 12; wave++) {
        check_one(nq, nk, 0, 0, 0, 0, 3, 2, wave, 2);
        check_one(nq, nk, 0, 0, 0, 0, 2, 5, wave, 1);
        check_one(nq, nk, 1, 0, 0, 0, 3, 2, wave, 2);
        check_one(nq, nk, 0, 1, 4, 2, 2, 3, wave, 3);
      }
  printf("%d passed, %d failed\n", g_cases - g_fail, g_fail);
  return g_fail ? 1 : 0;
}
