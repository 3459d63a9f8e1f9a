/* The Hopper kernels' tile shapes, forward and backward, in one place: the
 * forward's key tiles per padded head dim (fwd_bc) and the keys from which a
 * walk takes the wide ones (wide_min_keys), its blocks (FwdShape) and
 * shared-memory layout (FwdSmem); the backward's (BwdShape, BwdSmem). The
 * tables' entries can be overridden with -D in a tuning build, as the sm_80
 * kernels' FwdTraits/BwdTraits can: FA_SM90_FWD<D>_BC, _WIDE_BC and
 * _WIDE_MIN_KEYS for padded D = 64, 128, 192, 256, and FA_SM90_FWD_STAGES (the
 * K/V ring's depth). A shape the kernels cannot take fails to compile (the
 * static_asserts here and in the kernels, the wgmma widths wgmma.cuh
 * instantiates) or, where it spills, to build (spills are errors). The
 * defaults are the fastest measured (docs/PERF.md). */
#ifndef FA_CUDA_SM90_SHAPES_CUH
#define FA_CUDA_SM90_SHAPES_CUH

#include <stddef.h>
#include <stdint.h>

#include "sm90.h"
#include "wgmma.cuh"

#ifndef FA_SM90_FWD_STAGES
#define FA_SM90_FWD_STAGES 2
#endif

namespace fa {
namespace sm90 {

/* Key tile rows: 64 at D = 192 and 256, so that Q and two stages of K and V
 * fit (144 and 192 KB), else 128. Wide: the tiles of a walk that no band
 * cuts (band_free; no block mask, a contiguous cache), as wide as shared
 * memory holds with O unstaged: 176 at D = 128, 112 at 192, 80 at 256
 * (FlashAttention-3's tiles). Fewer tiles, so less of each tile's fixed
 * cost (its barriers, its row maxima, O's rescaling) per key. The scores of
 * 176 keys fit the consumers' 232 registers because a wide walk carries no
 * band arithmetic (fwd_mask) and makes Q's descriptors per tile (fwd_tiles). */
#ifndef FA_SM90_FWD64_BC
#define FA_SM90_FWD64_BC 128
#endif
#ifndef FA_SM90_FWD128_BC
#define FA_SM90_FWD128_BC 128
#endif
#ifndef FA_SM90_FWD192_BC
#define FA_SM90_FWD192_BC 64
#endif
#ifndef FA_SM90_FWD256_BC
#define FA_SM90_FWD256_BC 64
#endif
#ifndef FA_SM90_FWD64_WIDE_BC
#define FA_SM90_FWD64_WIDE_BC 128
#endif
#ifndef FA_SM90_FWD128_WIDE_BC
#define FA_SM90_FWD128_WIDE_BC 176
#endif
#ifndef FA_SM90_FWD192_WIDE_BC
#define FA_SM90_FWD192_WIDE_BC 112
#endif
#ifndef FA_SM90_FWD256_WIDE_BC
#define FA_SM90_FWD256_WIDE_BC 80
#endif
constexpr int kFwdBC[4] = {FA_SM90_FWD64_BC, FA_SM90_FWD128_BC, FA_SM90_FWD192_BC,
                           FA_SM90_FWD256_BC};
constexpr int kFwdWideBC[4] = {FA_SM90_FWD64_WIDE_BC, FA_SM90_FWD128_WIDE_BC,
                               FA_SM90_FWD192_WIDE_BC, FA_SM90_FWD256_WIDE_BC};
constexpr int fwd_bc(int d, bool wide) {
  const int i = headdim(d) / 64 - 1; /* the tables' entry */
  return wide ? kFwdWideBC[i] : kFwdBC[i];
}

/* Keys from which a walk that no band cuts takes the wide tiles (H100,
 * docs/PERF.md): from 2048 at D <= 192 (1024 keys: D = 128's 176-key tiles
 * 0.995x the 128-key ones, D = 192's 112-key tiles 0.95x); from 512 at
 * D = 256, whose 80-key tiles overlap their products and the narrow 64-key
 * ones do not (1.14x at 1024 keys, 1.05x at 512) */
#ifndef FA_SM90_FWD64_WIDE_MIN_KEYS
#define FA_SM90_FWD64_WIDE_MIN_KEYS 2048
#endif
#ifndef FA_SM90_FWD128_WIDE_MIN_KEYS
#define FA_SM90_FWD128_WIDE_MIN_KEYS 2048
#endif
#ifndef FA_SM90_FWD192_WIDE_MIN_KEYS
#define FA_SM90_FWD192_WIDE_MIN_KEYS 2048
#endif
#ifndef FA_SM90_FWD256_WIDE_MIN_KEYS
#define FA_SM90_FWD256_WIDE_MIN_KEYS 512
#endif
constexpr int64_t kFwdWideMinKeys[4] = {FA_SM90_FWD64_WIDE_MIN_KEYS, FA_SM90_FWD128_WIDE_MIN_KEYS,
                                        FA_SM90_FWD192_WIDE_MIN_KEYS, FA_SM90_FWD256_WIDE_MIN_KEYS};
constexpr int64_t wide_min_keys(int d) { return kFwdWideMinKeys[headdim(d) / 64 - 1]; }

/* NWG consumer warpgroups of 64 query rows: 2 at D = 128, 3 at D = 64 where
 * sm90_forward chooses it (FlashAttention-3's D = 64 shape: the products are
 * half as long, and a third warpgroup keeps the tensor cores fed), 1 for
 * decode blocks of 64 rows or fewer; key tiles of BC_ rows (fwd_bc). */
template <int D, int NWG_, int BC_>
struct FwdShape {
  static constexpr int NWG = NWG_, BR = 64 * NWG, BC = BC_, ST = FA_SM90_FWD_STAGES;
  /* O is staged through shared memory where a tile of it fits beside Q and
   * two stages of K and V; else (D = 256, the wide tiles) it goes from
   * registers straight to global memory */
  static constexpr bool STAGE_O = 2 * BR * D * 2 + 2 * ST * BC * D * 2 + 2048 <= 227 * 1024;
  /* the wide tiles (fwd_bc): their walks know no band */
  static constexpr bool WIDE = BC != fwd_bc(D, false);
  /* A tile's softmax runs under the previous tile's O += P V, and the two
   * consumer warpgroups take turns issuing their products (named barriers
   * 2 and 3): +0-8% per cell at D = 128; on the wide tiles +7-9% at
   * D = 192 and +2-15% at D = 256 (H100, 2k-16k keys). The narrow tiles of
   * D = 192 ran 9-14% slower so (with Q's descriptors made per tile,
   * without which they spill), at D = 256 they spill even then, and at
   * D = 64 the schedule was 8-15% slower: these keep one product at a time
   * (docs/PERF.md, "GPU forward"). Warpgroup 1's last arrival is left
   * pending at exit (barrier state does not outlive the CTA). */
  static constexpr bool OVERLAP = D == 128 || (D > 128 && WIDE);
  /* the turns of two consumer warpgroups (a decode kernel may have one) */
  static constexpr bool PINGPONG = OVERLAP && NWG == 2;
  /* the producer walks the schedule too: 24 registers spill; with one
   * consumer warpgroup there are registers to spare (at 40, 232 the D = 192
   * paged decode kernel spilled 4 bytes) */
  static constexpr int PRODUCER_REGS = NWG == 1 ? 64 : 40;
  static constexpr int CONSUMER_REGS = NWG == 1 ? 240 : NWG == 2 ? 232 : 152;
  static_assert(regs_split_fits(NWG + 1, PRODUCER_REGS, CONSUMER_REGS), "registers fit");
};

template <int D, int NWG, int KB>
struct FwdSmem {
  using S = FwdShape<D, NWG, KB>;
  static constexpr uint32_t QBYTES = S::BR * D * 2, TBYTES = S::BC * D * 2;
  /* O is staged (swizzled rows of D, stage_o_at) apart from Q */
  static constexpr uint32_t OBYTES = S::STAGE_O ? S::BR * D * 2 : 0;
  /* Q in a ring of QST stages: with two (where they fit: D <= 128) the
   * producer loads the next block's Q, and then its K/V tiles, while this
   * block computes; with one it can only start when this block's last
   * product is done, and every block begins with that load's latency */
  static constexpr int QST =
      2 * QBYTES + 2 * S::ST * TBYTES + OBYTES + 256 + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr uint32_t K0 = QST * QBYTES, V0 = K0 + S::ST * TBYTES, O0 = V0 + S::ST * TBYTES;
  static constexpr uint32_t BARS = O0 + OBYTES;
  /* barriers: q_full[QST], q_empty[QST], k_full[ST], v_full[ST],
   * k_empty[ST], v_empty[ST]; then the block index of Q's two phases, for
   * the consumers and for the producer's other warps (a paged cache), and
   * three blocks as the producer resolved them (FwdBlock, at most
   * BLOCK_BYTES each); plus 1 KB to align the base to 1024 bytes */
  static constexpr uint32_t SLOTS = BARS + 8 * (2 * QST + 4 * S::ST), PSLOTS = SLOTS + 8;
  static constexpr uint32_t BLOCKS = PSLOTS + 8, BLOCK_BYTES = 144;
  static constexpr size_t BYTES = BLOCKS + 3 * BLOCK_BYTES + 1024;
};

/* BR = 128 at D = 64: each step then carries twice the products for the
 * same waits and barriers. At D = 128 the accumulators of 128 query rows do
 * not fit beside dK and dV: BR = 64. Either way the tile's dQ (BR x D) is
 * 2 x 64 x 64: each warpgroup computes one 64 x 64 block over all BC keys,
 * reading both warpgroups' dS^T (double-buffered): split by query rows at
 * D = 64 (ROW_SPLIT), by columns of D at D = 128. The sum over the block's
 * keys then happens inside the product, and a step reduces one BR x D tile
 * into global memory, not one per warpgroup (which halved the reduce traffic
 * and the staging stores at D = 128; docs/PERF.md). */
template <int D>
struct BwdShape {
  /* COLS (D = 192, 256): dK and dV of 64 keys x D columns do not fit one
   * warpgroup's registers. Both warpgroups then take the same 64 keys and
   * each owns DC = D / 2 of the columns (of dK, dV and the tile's dQ); both
   * compute the whole S^T and dP^T (64 x 64; 1.4x the tensor work at 256),
   * so P^T and dS^T stay in each one's registers and neither waits for the
   * other's. Shared memory leaves room for one Q/dO stage at D = 256 (K, V
   * 64 KB; Q, dO 64 KB; dQ staging 64 KB), two at 192. */
  static constexpr bool COLS = D > 128;
  static constexpr int NWG = 2, BC = COLS ? 64 : 64 * NWG, BR = D <= 64 ? 128 : 64;
  static constexpr int ST = D > 192 ? 1 : 2, DC = COLS ? D / NWG : D;
  static constexpr int DQC = COLS ? DC : 64; /* columns of a warpgroup's dQ block */
  static constexpr bool ROW_SPLIT = !COLS && BR == 64 * NWG;
  static_assert(COLS ? BR == 64 && (DC == 96 || DC == 128) : BR * D == NWG * 64 * 64,
                "each warpgroup owns a 64 x DQC block of dQ");
  /* A warpgroup's dK/dV columns (and its dQ block's) as wgmma pieces PN0 and
   * PN1 wide (backward_sm90.cu's pieces_of). At D = 192 no 96-wide operand
   * could start inside a 64-column swizzle block: warpgroup 0 takes columns
   * 0-63 and 64-95, warpgroup 1 128-191 and 96-127, an N = 64 and an N = 32
   * product. */
  static constexpr int PN0 = DC == 96 ? 64 : DC, PN1 = DC - PN0;
  static constexpr int QN0 = COLS ? PN0 : DQC, QN1 = COLS ? PN1 : 0;
  static constexpr int DS_BUFS = COLS ? 1 : 2;
  static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
  static_assert(regs_split_fits(NWG + 1, PRODUCER_REGS, CONSUMER_REGS), "registers fit");
  /* deterministic mode: the producer walks a ticket's block (not blockIdx's,
   * which cost no registers) and the dQ writer its turns: 24 spill */
  static constexpr int DET_PRODUCER_REGS = 40, DET_CONSUMER_REGS = 232;
  static_assert(regs_split_fits(NWG + 1, DET_PRODUCER_REGS, DET_CONSUMER_REGS), "registers fit");
};

template <int D>
struct BwdSmem {
  using S = BwdShape<D>;
  static constexpr uint32_t KBYTES = S::BC * D * 2, QBYTES = S::BR * D * 2;
  static constexpr uint32_t V0 = KBYTES, Q0 = 2 * KBYTES, DO0 = Q0 + S::ST * QBYTES;
  /* per buffer and warpgroup: dS^T of its 64 keys x BR queries */
  static constexpr uint32_t DS0 = DO0 + S::ST * QBYTES, DSBYTES = 64 * S::BR * 2;
  /* per warpgroup: the 64 x DQC float32 dQ block it reduces, in 32-column boxes */
  static constexpr uint32_t DQ0 = DS0 + S::DS_BUFS * S::NWG * DSBYTES, DQBYTES = 64 * S::DQC * 4;
  /* per stage: the tile's lse2 and Di rows (BR floats each), next to its Q and dO */
  static constexpr uint32_t LSE0 = DQ0 + S::NWG * DQBYTES, LSEBYTES = 2 * S::BR * 4;
  static constexpr uint32_t BARS = LSE0 + S::ST * LSEBYTES;
  /* barriers: kv_full, q_full[ST], q_empty[ST]; the block's ticket
   * (deterministic mode); 1 KB to align the base */
  static constexpr uint32_t TICKET = BARS + 8 * (1 + 2 * S::ST);
  static constexpr size_t BYTES = TICKET + 8 + 1024;
};

}  // namespace sm90
}  // namespace fa

#endif
