// flashattn's PyTorch operators: flashattn::fwd and flashattn::bwd, registered with the
// dispatcher for CPU and CUDA tensors, with a C++ autograd kernel so that a backward pass
// costs one operator call; and flashattn::kvcache (flash_attn_with_kvcache, inference
// only), which writes the new keys and values into its cache arguments. The shape (fake) kernels
// live in python/flashattn/_ops.py.
//
// Every call resolves its arguments into fa_params and fa_tensor descriptors, allocates
// the outputs and the workspace with torch's allocators (the caching allocator on CUDA)
// and runs on the current stream; nothing synchronises with the host. Errors from the
// library become exceptions carrying "<function>: FA_<STATUS>: <fa_last_error()>", which
// python/flashattn/_ops.py turns into FlashAttnError.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/max.h>
#include <ATen/ops/min.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/version.h>
// Compiled autograd's node interface, as of the torch releases this was built and tested
// against (2.11 and later); older ones run this node in eager autograd only.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
#define FLASHATTN_COMPILED_AUTOGRAD 1
#include <torch/csrc/dynamo/compiled_autograd.h>
#endif
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#ifdef FLASHATTN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "flashattn.h"
#include "torch_ops.h"

namespace flashattn_torch {

const c10::TypedOperatorHandle<FwdSignature> &fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::fwd", "").typed<FwdSignature>();
  return op;
}

const c10::TypedOperatorHandle<BwdSignature> &bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::bwd", "").typed<BwdSignature>();
  return op;
}

const c10::TypedOperatorHandle<KvcacheSignature> &kvcache_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashattn::kvcache", "")
                             .typed<KvcacheSignature>();
  return op;
}

}  // namespace flashattn_torch

namespace {

using namespace flashattn_torch;

// ---- errors -------------------------------------------------------------------------

// The caller's input is at fault: ValueError / TypeError in Python.
#define FA_VALUE_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, "flashattn: ", __VA_ARGS__)
#define FA_TYPE_CHECK(cond, ...) TORCH_CHECK_TYPE(cond, "flashattn: ", __VA_ARGS__)

// "FA_ERR_UNSUPPORTED" for FA_ERR_UNSUPPORTED: the names python/flashattn/_ops.py reads back.
const char *status_name(fa_status st) {
  static const char *const names[] = {
      "FA_OK",         "FA_ERR_INVALID_ARGUMENT", "FA_ERR_UNSUPPORTED", "FA_ERR_OUT_OF_MEMORY",
      "FA_ERR_DEVICE", "FA_ERR_INTERNAL"};
  const unsigned i = static_cast<unsigned>(st);
  return i < sizeof names / sizeof *names ? names[i] : "FA_ERR_INTERNAL";
}

// A failed library call: the exception type follows the status (invalid argument ->
// ValueError, unsupported -> NotImplementedError, the rest RuntimeError).
void check_status(fa_status st, const char *function) {
  if (st == FA_OK) return;
  const std::string msg = std::string(function) + ": " + status_name(st) + ": " + fa_last_error();
  if (st == FA_ERR_INVALID_ARGUMENT) TORCH_CHECK_VALUE(false, msg);
  if (st == FA_ERR_UNSUPPORTED) TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
  TORCH_CHECK(false, msg);
}

// ---- tensors --------------------------------------------------------------------------

fa_dtype dtype_of(const Tensor &t, const char *name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return FA_DTYPE_F32;
    case at::kHalf:
      return FA_DTYPE_F16;
    case at::kBFloat16:
      return FA_DTYPE_BF16;
    case at::kDouble:
      return FA_DTYPE_F64;
    default:
      FA_TYPE_CHECK(false, name, ": unsupported dtype ", t.scalar_type(),
                    "; flashattn takes float32 (CPU), float16, bfloat16 and (CPU standard "
                    "algorithm only) float64");
  }
  return FA_DTYPE_F32;
}

fa_device fa_device_of(const Tensor &t) {
  if (t.is_cuda()) return FA_DEVICE_CUDA;
  FA_VALUE_CHECK(t.is_cpu(), "flashattn runs on cpu and cuda tensors, not on ", t.device());
  return FA_DEVICE_CPU;
}

void check_unit_last_stride(const Tensor &t, const char *name) {
  FA_VALUE_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1 || t.numel() == 0, name,
                 ": the last dimension (headdim) must be contiguous (stride 1), got strides ",
                 t.strides(), "; call .contiguous() first");
}

// How q, k, v (and so out, dq, dk, dv) are laid out: flash-attn's (batch, seqlen, heads,
// headdim), SDPA's (batch, heads, seqlen, headdim), or packed sequences (total, heads,
// headdim) with cu_seqlens. Only strides differ for the library.
enum class Layout { bnhd, bhnd, packed };

int seq_dim(Layout l) { return l == Layout::packed ? 0 : l == Layout::bhnd ? 2 : 1; }
int head_dim(Layout l) { return l == Layout::bnhd ? 2 : 1; }

const char *layout_name(Layout l) {
  switch (l) {
    case Layout::packed:
      return "(total_tokens, heads, headdim)";
    case Layout::bhnd:
      return "(batch, heads, seqlen, headdim)";
    default:
      return "(batch, seqlen, heads, headdim)";
  }
}

// The descriptor of a tensor in layout l (packed sequences as batch 1).
fa_tensor describe(const Tensor &t, fa_dtype dt, Layout l) {
  fa_tensor d;
  d.data = t.data_ptr();
  d.dtype = dt;
  const int sd = seq_dim(l), hd = head_dim(l);
  d.batch = l == Layout::packed ? 1 : t.size(0);
  d.stride_batch = l == Layout::packed ? 0 : t.stride(0);
  d.seqlen = t.size(sd);
  d.stride_seq = t.stride(sd);
  d.heads = t.size(hd);
  d.stride_head = t.stride(hd);
  d.headdim = t.size(-1);
  return d;
}

// q, k and v: kind, rank, dtype, device, last stride and how their shapes relate (the
// library checks the same, but an empty problem never reaches it).
// kl: k's and v's layout (l, or (num_pages, page_size, heads, headdim) pools of a paged
// cache); cache: k and v are a KV cache, whose batch may differ from q's.
fa_dtype check_qkv(const Tensor &q, const Tensor &k, const Tensor &v, Layout l, Layout kl,
                   bool paged, bool cache) {
  const Tensor *ts[3] = {&q, &k, &v};
  const char *names[3] = {"q", cache ? "k_cache" : "k", cache ? "v_cache" : "v"};
  for (int i = 0; i < 3; i++) {
    const Layout li = i == 0 ? l : kl;
    const int64_t nd = li == Layout::packed ? 3 : 4;
    FA_VALUE_CHECK(
        ts[i]->dim() == nd, names[i], " must have ", nd, " dimensions ",
        i > 0 && paged ? "(num_blocks, page_block_size, nheads_k, headdim)" : layout_name(li),
        ", got shape ", ts[i]->sizes());
  }
  const fa_dtype dt = dtype_of(q, "q");
  FA_TYPE_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "q, k and v must have the same dtype (q is ", q.scalar_type(), ", k is ",
                k.scalar_type(), ", v is ", v.scalar_type(), ")");
  FA_VALUE_CHECK(k.device() == q.device() && v.device() == q.device(),
                 "q, k and v must be on the same device (q is on ", q.device(), ", k on ",
                 k.device(), ", v on ", v.device(), ")");
  fa_device_of(q);
  for (int i = 0; i < 3; i++) check_unit_last_stride(*ts[i], names[i]);
  FA_VALUE_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape (k ", k.sizes(), ", v ",
                 v.sizes(), ")");
  FA_VALUE_CHECK(q.size(-1) == k.size(-1), "q and k must have the same head dimension (q ",
                 q.size(-1), ", k ", k.size(-1), ")");
  if (l != Layout::packed && !paged && !cache)
    FA_VALUE_CHECK(q.size(0) == k.size(0), "q and k must have the same batch size (q ", q.size(0),
                   ", k ", k.size(0), ")");
  const int64_t hq = q.size(head_dim(l)), hk = k.size(head_dim(kl));
  FA_VALUE_CHECK(hk == 0 || hq % hk == 0, "the number of q heads (", hq,
                 ") must be a multiple of the number of k/v heads (", hk, ")");
  return dt;
}

// x must be shaped, typed and placed like ref, headdim contiguous.
void check_like(const Tensor &x, const char *name, const Tensor &ref, const char *ref_name) {
  FA_VALUE_CHECK(x.sizes() == ref.sizes(), name, " must have the shape of ", ref_name, " ",
                 ref.sizes(), ", got ", x.sizes());
  FA_TYPE_CHECK(x.scalar_type() == ref.scalar_type(), name, " must have the dtype of ", ref_name,
                " (", ref.scalar_type(), "), got ", x.scalar_type());
  FA_VALUE_CHECK(x.device() == ref.device(), name, " must be on the device of ", ref_name, " (",
                 ref.device(), "), got ", x.device());
  check_unit_last_stride(x, name);
}

// Small side inputs (offsets, slopes, masks): on q's device, made contiguous of the
// dtype the library reads.
Tensor side_input(const Tensor &x, const char *name, const Tensor &q, at::ScalarType want) {
  FA_VALUE_CHECK(x.device() == q.device(), name, " must be on the same device as q (", q.device(),
                 "), got ", x.device());
  if (want == at::kInt)
    FA_TYPE_CHECK(!at::isFloatingType(x.scalar_type()) && !at::isComplexType(x.scalar_type()), name,
                  " must be an integer tensor (int32), got ", x.scalar_type());
  if (x.scalar_type() == want && x.is_contiguous()) return x;
  if (want == at::kInt && x.scalar_type() != at::kInt && x.numel() > 0) {
    // wider integers would wrap silently: checked on the host, clamped on a device (whose
    // out-of-range values the library clamps as well), so no synchronisation
    const int64_t lo = INT32_MIN, hi = INT32_MAX;
    if (x.is_cpu()) {
      const int64_t mn = x.min().item<int64_t>(), mx = x.max().item<int64_t>();
      FA_VALUE_CHECK(mn >= lo && mx <= hi, name, " has values outside int32 (min ", mn, ", max ",
                     mx, ")");
    } else {
      return x.clamp(lo, hi).to(want).contiguous();
    }
  }
  return x.to(want).contiguous();
}

// ---- the attention variant --------------------------------------------------------------

// The op arguments every pass shares, resolved into fa_params; `keep` holds converted
// side inputs alive for the call.
struct Resolved {
  fa_params p;
  fa_dtype dt;
  Layout layout, kv_layout;  // q's (and out's); k's and v's
  Tensor keep[6];
};

constexpr float kTinyScale = std::numeric_limits<float>::denorm_min();

Resolved resolve(const Tensor &q, const Tensor &k, const Tensor &v, const Options &o) {
  Resolved r;
  fa_params &p = r.p;
  p = fa_params{};
  const bool varlen = o.cu_seqlens_q.has_value() || o.cu_seqlens_k.has_value();
  FA_VALUE_CHECK(o.cu_seqlens_q.has_value() == o.cu_seqlens_k.has_value(),
                 "cu_seqlens_q and cu_seqlens_k must be given together");
  FA_VALUE_CHECK(!(varlen && o.bhnd),
                 "packed sequences (cu_seqlens) have no (batch, heads, seqlen, headdim) layout");
  r.layout = varlen ? Layout::packed : o.bhnd ? Layout::bhnd : Layout::bnhd;
  const bool paged = o.block_table.has_value();
  FA_VALUE_CHECK(!(paged && o.bhnd),
                 "block_table (a paged KV cache) has no (batch, heads, seqlen, headdim) layout");
  // page pools are (num_pages, page_size, heads_k, headdim), whatever q's layout
  r.kv_layout = paged ? Layout::bnhd : r.layout;
  r.dt = check_qkv(q, k, v, r.layout, r.kv_layout, paged, o.kvcache);
  p.device = fa_device_of(q);
  FA_VALUE_CHECK(o.algorithm >= FA_ALGO_FLASH2 && o.algorithm <= FA_ALGO_STANDARD,
                 "unknown algorithm ", o.algorithm);
  p.algorithm = static_cast<fa_algorithm>(o.algorithm);
  // The library reads 0 as 1/sqrt(headdim); an explicit 0 (uniform attention) becomes
  // the smallest positive float, which gives the same result.
  if (o.softmax_scale.has_value())
    p.softmax_scale = *o.softmax_scale == 0.0 ? kTinyScale : static_cast<float>(*o.softmax_scale);
  p.causal = o.causal;
  p.window_enabled = o.window_left >= 0 || o.window_right >= 0;
  p.window_left = o.window_left >= 0 ? o.window_left : -1;
  p.window_right = o.window_right >= 0 ? o.window_right : -1;
  p.softcap = static_cast<float>(o.softcap);
  p.dropout_p = static_cast<float>(o.dropout_p);
  p.deterministic = o.deterministic;
  p.block_size_q = o.block_size_q;
  p.block_size_k = o.block_size_k;
  FA_VALUE_CHECK((o.shard_q >= 0) == (o.shard_k >= 0),
                 "shard_q and shard_k must be given together (got ", o.shard_q, ", ", o.shard_k,
                 ")");
  p.shard_enabled = o.shard_q >= 0;
  p.shard_q_offset = p.shard_enabled ? o.shard_q : 0;
  p.shard_k_offset = p.shard_enabled ? o.shard_k : 0;
  if (p.device == FA_DEVICE_CPU) p.num_threads = at::get_num_threads();

  const int64_t hq = q.size(head_dim(r.layout));
  int64_t num_seqs = varlen ? 0 : q.size(0);
  if (varlen) {
    Tensor cq = side_input(*o.cu_seqlens_q, "cu_seqlens_q", q, at::kInt);
    Tensor ck = side_input(*o.cu_seqlens_k, "cu_seqlens_k", q, at::kInt);
    FA_VALUE_CHECK(cq.dim() == 1 && cq.size(0) >= 2,
                   "cu_seqlens_q must be 1-D with batch_size + 1 >= 2 entries, got shape ",
                   cq.sizes());
    FA_VALUE_CHECK(ck.dim() == 1 && ck.size(0) >= 2,
                   "cu_seqlens_k must be 1-D with batch_size + 1 >= 2 entries, got shape ",
                   ck.sizes());
    FA_VALUE_CHECK(cq.size(0) == ck.size(0),
                   "cu_seqlens_q and cu_seqlens_k must have the same length (", cq.size(0), ", ",
                   ck.size(0), ")");
    num_seqs = cq.size(0) - 1;
    p.cu_seqlens_q = cq.data_ptr<int32_t>();
    p.cu_seqlens_k = ck.data_ptr<int32_t>();
    p.num_seqs = num_seqs;
    r.keep[0] = cq;
    r.keep[1] = ck;
  }
  if (o.alibi_slopes.has_value()) {
    Tensor a = side_input(*o.alibi_slopes, "alibi_slopes", q, at::kFloat);
    if (a.dim() == 1 && a.size(0) == hq) {
      p.alibi_stride_batch = 0;
    } else {
      FA_VALUE_CHECK(a.dim() == 2 && a.size(0) == num_seqs && a.size(1) == hq,
                     "alibi_slopes must have shape (nheads,) = (", hq,
                     ",) or (batch_size, nheads) = (", num_seqs, ", ", hq, "), got ", a.sizes());
      p.alibi_stride_batch = hq;
    }
    p.alibi_slopes = a.data_ptr<float>();
    r.keep[2] = a;
  }
  if (o.block_mask.has_value()) {
    FA_VALUE_CHECK(o.block_size_q >= 1 && o.block_size_k >= 1,
                   "block_mask needs block_size=(block_q, block_k), the query rows and keys "
                   "each mask entry covers (got block_size (",
                   o.block_size_q, ", ", o.block_size_k, "))");
    const Tensor &bm = *o.block_mask;
    Tensor m = bm.scalar_type() == at::kBool ? bm : side_input(bm, "block_mask", q, at::kByte);
    if (m.scalar_type() == at::kBool) {
      FA_VALUE_CHECK(m.device() == q.device(), "block_mask must be on the same device as q (",
                     q.device(), "), got ", m.device());
      m = m.contiguous().view(at::kByte);
    }
    // the rows the mask must cover: the sequence length (varlen: the total, a bound)
    const int64_t nq = q.size(seq_dim(r.layout));
    const int64_t nk = k.size(seq_dim(r.kv_layout));
    const int64_t need_q = (nq + o.block_size_q - 1) / o.block_size_q;
    const int64_t need_k = (nk + o.block_size_k - 1) / o.block_size_k;
    FA_VALUE_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == num_seqs) &&
                       (m.size(1) == 1 || m.size(1) == hq) && m.size(2) >= need_q &&
                       m.size(3) >= need_k,
                   "block_mask must have shape (batch_size or 1, nheads or 1, >= ", need_q,
                   " query blocks, >= ", need_k, " key blocks), got ", m.sizes());
    p.block_mask_stride_row = m.size(3);
    p.block_mask_stride_head = m.size(1) == 1 ? 0 : m.size(2) * m.size(3);
    p.block_mask_stride_batch = m.size(0) == 1 ? 0 : m.size(1) * m.size(2) * m.size(3);
    p.block_mask = m.data_ptr<uint8_t>();
    r.keep[3] = m;
  }
  if (o.seqused_k.has_value()) {
    Tensor u = side_input(*o.seqused_k, "seqused_k", q, at::kInt);
    FA_VALUE_CHECK(u.dim() == 1 && u.size(0) == num_seqs,
                   "seqused_k must have shape (batch_size,) = (", num_seqs, ",), got ", u.sizes());
    p.seqused_k = u.data_ptr<int32_t>();
    r.keep[4] = u;
  }
  if (paged) {
    Tensor bt = side_input(*o.block_table, "block_table", q, at::kInt);
    FA_VALUE_CHECK(bt.dim() == 2 && bt.size(0) == num_seqs && bt.size(1) >= 1,
                   "block_table must have shape (batch_size, max_num_blocks_per_seq) = (", num_seqs,
                   ", >= 1), got ", bt.sizes());
    p.block_table = bt.data_ptr<int32_t>();
    p.block_table_stride = bt.size(1);
    p.max_pages_per_seq = bt.size(1);
    r.keep[5] = bt;
  }
  FA_VALUE_CHECK(o.num_splits >= 0 && o.num_splits <= 128,
                 "num_splits must be in [0, 128] (0: chosen by the library), got ", o.num_splits);
  p.num_splits = static_cast<int>(o.num_splits);
  FA_VALUE_CHECK(o.sm_margin >= 0 && o.sm_margin <= 1024, "sm_margin must be in [0, 1024], got ",
                 o.sm_margin);
  p.sm_margin = static_cast<int>(o.sm_margin);
  if (o.rng_state.has_value() && o.dropout_p > 0) {
    const Tensor &s = *o.rng_state;
    FA_VALUE_CHECK(s.is_cpu() && s.scalar_type() == at::kLong && s.numel() == 2,
                   "rng_state must be a CPU int64 tensor (seed, offset), got ", s.scalar_type(),
                   " ", s.sizes(), " on ", s.device());
    const Tensor c = s.contiguous();
    p.dropout_seed = static_cast<uint64_t>(c.data_ptr<int64_t>()[0]);
    p.dropout_offset = static_cast<uint64_t>(c.data_ptr<int64_t>()[1]);
  }
  return r;
}

// 0: a problem for the library; 1: no query rows (nothing to compute); 2: no keys (every
// row fully masked). The library takes no empty tensors.
// A paged problem's keys are in its table: the library sees it whatever k's shape.
int empty_problem(const Tensor &q, const Tensor &k, const Resolved &r) {
  if (q.size(-1) < 1 || q.size(-1) > FA_MAX_HEADDIM) return 0;  // the library's error
  if (q.numel() == 0) return 1;
  if (r.p.block_table) return 0;
  return k.size(seq_dim(r.kv_layout)) == 0 ? 2 : 0;
}

std::vector<int64_t> lse_shape(const Tensor &q, Layout l) {
  if (l == Layout::packed) return {q.size(1), q.size(0)};       // (heads, total_q)
  return {q.size(0), q.size(head_dim(l)), q.size(seq_dim(l))};  // (batch, heads, seqlen_q)
}

// The device context of a call: the device guard and, on CUDA, the current stream.
struct DeviceScope {
  c10::OptionalDeviceGuard guard;
  explicit DeviceScope(const Tensor &q, fa_params &p) {
    if (p.device != FA_DEVICE_CUDA) return;
    guard.reset_device(q.device());
#ifdef FLASHATTN_TORCH_CUDA
    p.stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
#endif
  }
};

// Scratch memory of `bytes`, 64-byte aligned, from torch's allocator for q's device (on
// CUDA, freed back to the caching allocator in stream order).
Tensor workspace(fa_params &p, size_t bytes, const Tensor &q) {
  if (bytes == 0) return Tensor();
  Tensor buf = at::empty({static_cast<int64_t>(bytes) + 64}, q.options().dtype(at::kByte));
  const uintptr_t addr = reinterpret_cast<uintptr_t>(buf.data_ptr());
  p.workspace = reinterpret_cast<void *>((addr + 63) & ~static_cast<uintptr_t>(63));
  p.workspace_bytes = bytes;
  return buf;
}

// (seed, offset) of the dropout mask: drawn from torch's default CPU generator (so
// torch.manual_seed fixes it) unless given; (0, 0) without dropout.
Tensor make_rng_state(Resolved &r, double dropout_p, const optional<Tensor> &given) {
  Tensor s = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  int64_t *v = s.data_ptr<int64_t>();
  if (dropout_p > 0 && !given.has_value()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    // what torch.randint(0, 2**62, (1,)) would give
    r.p.dropout_seed = gen.get<at::CPUGeneratorImpl>()->random64() % (uint64_t{1} << 62);
    r.p.dropout_offset = 0;
  }
  v[0] = static_cast<int64_t>(r.p.dropout_seed);
  v[1] = static_cast<int64_t>(r.p.dropout_offset);
  return s;
}

#ifdef FLASHATTN_TORCH_CUDA
// A dropout seed drawn while a CUDA graph is captured would be replayed unchanged: the
// same mask on every replay. A seed the caller passes is the caller's choice.
void refuse_captured_draw(const fa_params &p, double dropout_p, const optional<Tensor> &given) {
  if (p.device != FA_DEVICE_CUDA || !(dropout_p > 0) || given.has_value()) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(p.stream), &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  FA_VALUE_CHECK(status == cudaStreamCaptureStatusNone,
                 "dropout inside a CUDA graph capture would replay one mask forever; pass "
                 "dropout_p=0 while capturing");
}
#endif

// ---- the operators ----------------------------------------------------------------------

Tensors3 fwd_kernel(const Tensor &q, const Tensor &k, const Tensor &v,
                    const optional<Tensor> &cu_seqlens_q, const optional<Tensor> &cu_seqlens_k,
                    const optional<Tensor> &seqused_k, const optional<Tensor> &alibi_slopes,
                    const optional<Tensor> &block_mask, optional<double> softmax_scale, bool causal,
                    int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                    const optional<Tensor> &rng_state, bool deterministic, int64_t algorithm,
                    int64_t block_size_q, int64_t block_size_k, bool bhnd, int64_t shard_q,
                    int64_t shard_k, const optional<Tensor> &block_table, int64_t num_splits,
                    int64_t sm_margin) {
  Resolved r = resolve(
      q, k, v,
      Options{cu_seqlens_q,  cu_seqlens_k, seqused_k,    alibi_slopes, block_mask, softmax_scale,
              causal,        window_left,  window_right, softcap,      dropout_p,  rng_state,
              deterministic, algorithm,    block_size_q, block_size_k, bhnd,       shard_q,
              shard_k,       block_table,  num_splits,   sm_margin});
  DeviceScope scope(q, r.p);
  // SDPA's layout: out in (batch, seqlen, heads, headdim) memory order, so that the
  // caller's out.transpose(1, 2) is contiguous (as torch's CUDA flash SDPA returns it)
  Tensor out =
      r.layout == Layout::bhnd
          ? at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2)
          : at::empty_like(q);
  Tensor lse = at::empty(lse_shape(q, r.layout), q.options().dtype(at::kFloat));
#ifdef FLASHATTN_TORCH_CUDA
  refuse_captured_draw(r.p, dropout_p, rng_state);
#endif
  Tensor rng = make_rng_state(r, dropout_p, rng_state);
  const int empty = empty_problem(q, k, r);
  if (empty) {
    if (empty == 2) {
      out.zero_();
      lse.fill_(-std::numeric_limits<double>::infinity());
    }
    return {out, lse, rng};
  }
  fa_tensor tq = describe(q, r.dt, r.layout), tk = describe(k, r.dt, r.kv_layout);
  fa_tensor tv = describe(v, r.dt, r.kv_layout), to = describe(out, r.dt, r.layout);
  size_t bytes = 0;
  check_status(fa_workspace_size(FA_PASS_FORWARD, &r.p, &tq, &tk, &tv, &bytes), "fa_forward");
  Tensor ws = workspace(r.p, bytes, q);
  check_status(fa_forward(&r.p, &tq, &tk, &tv, &to, lse.data_ptr<float>()), "fa_forward");
  return {out, lse, rng};
}

Tensors3 bwd_kernel(const Tensor &dout, const Tensor &q, const Tensor &k, const Tensor &v,
                    const Tensor &out, const Tensor &lse, const optional<Tensor> &cu_seqlens_q,
                    const optional<Tensor> &cu_seqlens_k, const optional<Tensor> &seqused_k,
                    const optional<Tensor> &alibi_slopes, const optional<Tensor> &block_mask,
                    optional<double> softmax_scale, bool causal, int64_t window_left,
                    int64_t window_right, double softcap, double dropout_p,
                    const optional<Tensor> &rng_state, bool deterministic, int64_t algorithm,
                    int64_t block_size_q, int64_t block_size_k, bool bhnd, int64_t shard_q,
                    int64_t shard_k, const optional<Tensor> &block_table, int64_t num_splits,
                    int64_t sm_margin) {
  FA_VALUE_CHECK(dropout_p == 0 || rng_state.has_value(),
                 "the backward of dropout needs the forward's rng_state");
  // the library's refusal, also for the empty problems that never reach it
  TORCH_CHECK_NOT_IMPLEMENTED(!block_table.has_value(),
                              "fa_backward: FA_ERR_UNSUPPORTED: params.block_table: the backward "
                              "pass does not take a paged KV cache (paged attention is "
                              "inference-only)");
  Resolved r = resolve(
      q, k, v,
      Options{cu_seqlens_q,  cu_seqlens_k, seqused_k,    alibi_slopes, block_mask, softmax_scale,
              causal,        window_left,  window_right, softcap,      dropout_p,  rng_state,
              deterministic, algorithm,    block_size_q, block_size_k, bhnd,       shard_q,
              shard_k,       block_table,  num_splits,   sm_margin});
  check_like(out, "out", q, "q");
  // dout of a sum() is an expanded scalar (every stride 0): copied once here
  const Tensor g =
      dout.dim() == q.dim() && dout.size(-1) > 1 && dout.stride(-1) != 1 ? dout.contiguous() : dout;
  check_like(g, "dout", q, "q");
  const std::vector<int64_t> want = lse_shape(q, r.layout);
  FA_VALUE_CHECK(lse.sizes() == c10::IntArrayRef(want) && lse.scalar_type() == at::kFloat,
                 "lse must be the forward's log-sum-exp, float32 of shape ", c10::IntArrayRef(want),
                 ", got ", lse.scalar_type(), " ", lse.sizes());
  FA_VALUE_CHECK(lse.device() == q.device(), "lse must be on q's device (", q.device(), "), got ",
                 lse.device());
  const Tensor l = lse.contiguous();
  DeviceScope scope(q, r.p);
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (empty_problem(q, k, r)) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  fa_tensor tq = describe(q, r.dt, r.layout), tk = describe(k, r.dt, r.layout);
  fa_tensor tv = describe(v, r.dt, r.layout), to = describe(out, r.dt, r.layout);
  fa_tensor tdo = describe(g, r.dt, r.layout), tdq = describe(dq, r.dt, r.layout);
  fa_tensor tdk = describe(dk, r.dt, r.layout), tdv = describe(dv, r.dt, r.layout);
  size_t bytes = 0;
  check_status(fa_workspace_size(FA_PASS_BACKWARD, &r.p, &tq, &tk, &tv, &bytes), "fa_backward");
  Tensor ws = workspace(r.p, bytes, q);
  check_status(fa_backward(&r.p, &tq, &tk, &tv, &to, &tdo, l.data_ptr<float>(), &tdq, &tdk, &tdv),
               "fa_backward");
  return {dq, dk, dv};
}

// The KV-cache call's small int32 inputs (cache_seqlens, cache_batch_idx,
// cache_leftpad): one per batch entry, on q's device.
Tensor per_sequence(const Tensor &x, const char *name, const Tensor &q) {
  Tensor t = side_input(x, name, q, at::kInt);
  FA_VALUE_CHECK(t.dim() == 1 && t.size(0) == q.size(0), name, " must have shape (batch_size,) = (",
                 q.size(0), ",), got ", t.sizes());
  return t;
}

// A rotary table: (seqlen_ro, rotary_dim / 2) in q's dtype on q's device, rows at any
// stride.
void check_rotary(const Tensor &t, const char *name, const Tensor &q) {
  FA_VALUE_CHECK(t.dim() == 2 && t.size(0) >= 1 && t.size(1) >= 1, name,
                 " must have shape (seqlen_ro, rotary_dim / 2), got ", t.sizes());
  FA_TYPE_CHECK(t.scalar_type() == q.scalar_type(), name, " must have q's dtype (", q.scalar_type(),
                "), got ", t.scalar_type());
  FA_VALUE_CHECK(t.device() == q.device(), name, " must be on q's device (", q.device(), "), got ",
                 t.device());
  FA_VALUE_CHECK(t.size(1) <= 1 || t.stride(1) == 1, name,
                 ": the last dimension must be contiguous (stride 1), got strides ", t.strides(),
                 "; call .contiguous() first");
  FA_VALUE_CHECK(t.stride(0) >= 0, name, ": negative strides are not supported");
}

std::tuple<Tensor, Tensor> kvcache_kernel(
    const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &cache_seqlens,
    const optional<Tensor> &k, const optional<Tensor> &v, const optional<Tensor> &rotary_cos,
    const optional<Tensor> &rotary_sin, const optional<Tensor> &cache_batch_idx,
    const optional<Tensor> &cache_leftpad, const optional<Tensor> &block_table,
    const optional<Tensor> &alibi_slopes, optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, int64_t algorithm) {
  Options o;
  o.alibi_slopes = alibi_slopes;
  o.softmax_scale = softmax_scale;
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.softcap = softcap;
  o.algorithm = algorithm;
  o.block_table = block_table;
  o.num_splits = num_splits;
  o.kvcache = true;
  Resolved r = resolve(q, k_cache, v_cache, o);
  fa_kvcache kv{};
  const Tensor seqlens = per_sequence(cache_seqlens, "cache_seqlens", q);
  kv.cache_seqlens = seqlens.data_ptr<int32_t>();
  Tensor batch_idx, leftpad;
  if (cache_batch_idx.has_value()) {
    batch_idx = per_sequence(*cache_batch_idx, "cache_batch_idx", q);
    kv.cache_batch_idx = batch_idx.data_ptr<int32_t>();
  }
  if (cache_leftpad.has_value()) {
    leftpad = per_sequence(*cache_leftpad, "cache_leftpad", q);
    kv.cache_leftpad = leftpad.data_ptr<int32_t>();
  }
  FA_VALUE_CHECK(k.has_value() == v.has_value(), "k and v must be given together");
  // new rows: (batch, seqlen_new, nheads_k, headdim); none (seqlen_new 0) is no append
  const bool append = k.has_value() && k->dim() == 4 && k->size(1) > 0;
  fa_tensor tkn{}, tvn{};
  if (k.has_value()) {
    FA_VALUE_CHECK(k->dim() == 4,
                   "k must have 4 dimensions (batch, seqlen_new, nheads_k, "
                   "headdim), got shape ",
                   k->sizes());
    check_like(*v, "v", *k, "k");
    FA_TYPE_CHECK(k->scalar_type() == q.scalar_type(), "k and v must have q's dtype (",
                  q.scalar_type(), "), got ", k->scalar_type());
    FA_VALUE_CHECK(k->device() == q.device(), "k and v must be on q's device (", q.device(),
                   "), got ", k->device());
    check_unit_last_stride(*k, "k");
    if (append) {
      tkn = describe(*k, r.dt, Layout::bnhd);
      tvn = describe(*v, r.dt, Layout::bnhd);
      kv.k_new = &tkn;
      kv.v_new = &tvn;
    }
  }
  FA_VALUE_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
                 "rotary_cos and rotary_sin must be given together");
  if (rotary_cos.has_value()) {
    check_rotary(*rotary_cos, "rotary_cos", q);
    check_rotary(*rotary_sin, "rotary_sin", q);
    FA_VALUE_CHECK(rotary_sin->sizes() == rotary_cos->sizes(),
                   "rotary_cos and rotary_sin must have the same shape (rotary_cos ",
                   rotary_cos->sizes(), ", rotary_sin ", rotary_sin->sizes(), ")");
    FA_VALUE_CHECK(rotary_sin->stride(0) == rotary_cos->stride(0),
                   "rotary_cos and rotary_sin must have the same row stride (",
                   rotary_cos->stride(0), ", ", rotary_sin->stride(0), ")");
    FA_VALUE_CHECK(k.has_value(),
                   "rotary_cos: rotary embedding needs k and v (the new keys "
                   "it rotates)");
    kv.rotary_cos = rotary_cos->data_ptr();
    kv.rotary_sin = rotary_sin->data_ptr();
    kv.rotary_seqlen = rotary_cos->size(0);
    kv.rotary_dim = 2 * rotary_cos->size(1);
    kv.rotary_stride = rotary_cos->stride(0);
    kv.rotary_interleaved = rotary_interleaved;
  }
  DeviceScope scope(q, r.p);
  Tensor out = at::empty_like(q);
  Tensor lse = at::empty(lse_shape(q, r.layout), q.options().dtype(at::kFloat));
  if (q.size(0) == 0) return {out, lse};  // no batch entry: nothing to write or compute
  fa_tensor tq = describe(q, r.dt, r.layout), to = describe(out, r.dt, r.layout);
  fa_tensor tk = describe(k_cache, r.dt, r.kv_layout), tv = describe(v_cache, r.dt, r.kv_layout);
  size_t bytes = 0;
  check_status(fa_kvcache_workspace_size(&r.p, &kv, &tq, &tk, &tv, &bytes), "fa_forward_kvcache");
  Tensor ws = workspace(r.p, bytes, q);
  check_status(fa_forward_kvcache(&r.p, &kv, &tq, &tk, &tv, &to, lse.data_ptr<float>()),
               "fa_forward_kvcache");
  return {out, lse};
}

// ---- autograd ---------------------------------------------------------------------------

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

optional<Tensor> or_none(const Tensor &t) {
  return t.defined() ? optional<Tensor>(t) : optional<Tensor>();
}
Tensor or_undefined(const optional<Tensor> &t) { return t.has_value() ? *t : Tensor(); }

// fwd's derivative: one flashattn::bwd call (traced as such under torch.compile). A node
// of its own rather than a torch::autograd::Function, whose generic bookkeeping (a map of
// saved values, per-output metadata) costs more host time than the call it records.
struct AttentionBackward final : public torch::autograd::Node {
  SavedVariable q, k, v, out, lse, rng, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
      block_mask, block_table;
  optional<double> softmax_scale;
  bool causal = false, deterministic = false, bhnd = false;
  int64_t window_left = -1, window_right = -1, algorithm = 0, block_size_q = 0, block_size_k = 0;
  int64_t shard_q = -1, shard_k = -1, num_splits = 0, sm_margin = 0;
  double softcap = 0, dropout_p = 0;

  std::string name() const override { return "FlashAttnBackward"; }

  void release_variables() override {
    for (SavedVariable *sv : {&q, &k, &v, &out, &lse, &rng, &cu_seqlens_q, &cu_seqlens_k,
                              &seqused_k, &alibi_slopes, &block_mask, &block_table})
      sv->reset_data();
  }

#ifdef FLASHATTN_COMPILED_AUTOGRAD
  // Compiled autograd (torch._dynamo.compiled_autograd): the saved tensors become graph
  // inputs, the options part of the cache key, and apply() is traced.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &args) const override {
    for (const SavedVariable *sv : {&q, &k, &v, &lse, &rng, &cu_seqlens_q, &cu_seqlens_k,
                                    &seqused_k, &alibi_slopes, &block_mask, &block_table})
      args.collect(*sv, false);
    args.collect(out, true);
    args.collect(softmax_scale);
    args.collect(causal);
    args.collect(deterministic);
    args.collect(bhnd);
    args.collect(window_left);
    args.collect(window_right);
    args.collect(algorithm);
    args.collect(block_size_q);
    args.collect(block_size_k);
    args.collect(shard_q);
    args.collect(shard_k);
    args.collect(num_splits);
    args.collect(sm_margin);
    args.collect(softcap);
    args.collect(dropout_p);
  }

  variable_list apply_with_saved(const variable_list &grads,
                                 torch::dynamo::autograd::SwapSavedVariables &saved) override {
    SavedVariable *all[] = {&q,
                            &k,
                            &v,
                            &out,
                            &lse,
                            &rng,
                            &cu_seqlens_q,
                            &cu_seqlens_k,
                            &seqused_k,
                            &alibi_slopes,
                            &block_mask,
                            &block_table};
    for (SavedVariable *sv : all) saved.before(*sv);
    variable_list r = apply(variable_list(grads));
    for (SavedVariable *sv : all) saved.after(*sv);
    return r;
  }
#endif

  variable_list apply(variable_list &&grads) override {
    const Tensor &dout = grads[0];
    if (!dout.defined()) return variable_list(3);  // out was not used
    const auto self = getptr();
    auto [dq, dk, dv] = bwd_op().call(
        dout, q.unpack(), k.unpack(), v.unpack(), out.unpack(self), lse.unpack(),
        or_none(cu_seqlens_q.unpack()), or_none(cu_seqlens_k.unpack()), or_none(seqused_k.unpack()),
        or_none(alibi_slopes.unpack()), or_none(block_mask.unpack()), softmax_scale, causal,
        window_left, window_right, softcap, dropout_p, or_none(rng.unpack()), deterministic,
        algorithm, block_size_q, block_size_k, bhnd, shard_q, shard_k,
        or_none(block_table.unpack()), num_splits, sm_margin);
    return variable_list{dq, dk, dv};
  }
};

// A node held the way this torch holds nodes (std::shared_ptr in older releases,
// c10::intrusive_ptr in newer ones).
using NodePtr = decltype(std::declval<torch::autograd::Node &>().getptr());

template <typename T>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<T>();
  else
    return c10::make_intrusive<T>();
}

Tensors3 fwd_autograd(const Tensor &q, const Tensor &k, const Tensor &v,
                      const optional<Tensor> &cu_seqlens_q, const optional<Tensor> &cu_seqlens_k,
                      const optional<Tensor> &seqused_k, const optional<Tensor> &alibi_slopes,
                      const optional<Tensor> &block_mask, optional<double> softmax_scale,
                      bool causal, int64_t window_left, int64_t window_right, double softcap,
                      double dropout_p, const optional<Tensor> &rng_state, bool deterministic,
                      int64_t algorithm, int64_t block_size_q, int64_t block_size_k, bool bhnd,
                      int64_t shard_q, int64_t shard_k, const optional<Tensor> &block_table,
                      int64_t num_splits, int64_t sm_margin) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !q._fw_grad(0).defined() && !k._fw_grad(0).defined() && !v._fw_grad(0).defined(),
      "flashattn: forward-mode AD (dual tensors) is not supported by flashattn::fwd");
  decltype(make_node<AttentionBackward>()) node;
  if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    node = make_node<AttentionBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
  }
  Tensors3 r;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    r = fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_mask,
                      softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                      rng_state, deterministic, algorithm, block_size_q, block_size_k, bhnd,
                      shard_q, shard_k, block_table, num_splits, sm_margin);
  }
  if (node) {
    Tensor &out = std::get<0>(r);
    torch::autograd::set_history(out, node);
    node->q = SavedVariable(q, false);
    node->k = SavedVariable(k, false);
    node->v = SavedVariable(v, false);
    node->out = SavedVariable(out, true);
    node->lse = SavedVariable(std::get<1>(r), false);
    node->rng = SavedVariable(std::get<2>(r), false);
    node->cu_seqlens_q = SavedVariable(or_undefined(cu_seqlens_q), false);
    node->cu_seqlens_k = SavedVariable(or_undefined(cu_seqlens_k), false);
    node->seqused_k = SavedVariable(or_undefined(seqused_k), false);
    node->alibi_slopes = SavedVariable(or_undefined(alibi_slopes), false);
    node->block_mask = SavedVariable(or_undefined(block_mask), false);
    node->softmax_scale = softmax_scale;
    node->causal = causal;
    node->window_left = window_left;
    node->window_right = window_right;
    node->softcap = softcap;
    node->dropout_p = dropout_p;
    node->deterministic = deterministic;
    node->algorithm = algorithm;
    node->block_size_q = block_size_q;
    node->block_size_k = block_size_k;
    node->bhnd = bhnd;
    node->shard_q = shard_q;
    node->shard_k = shard_k;
    node->block_table = SavedVariable(or_undefined(block_table), false);
    node->num_splits = num_splits;
    node->sm_margin = sm_margin;
  }
  return r;
}

}  // namespace

// Optional tensors a later feature adds (a page table, rotary tables) go at the end of a
// schema with a None default, so that existing callers keep working.
TORCH_LIBRARY(flashattn, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
      "Tensor? seqused_k=None, Tensor? alibi_slopes=None, Tensor? block_mask=None, "
      "float? softmax_scale=None, bool causal=False, int window_left=-1, int window_right=-1, "
      "float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None, bool deterministic=False, "
      "int algorithm=0, int block_size_q=0, int block_size_k=0, bool bhnd=False, "
      "int shard_q=-1, int shard_k=-1, Tensor? block_table=None, int num_splits=0, "
      "int sm_margin=0) -> (Tensor out, Tensor lse, Tensor rng_state)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_k=None, "
      "Tensor? alibi_slopes=None, Tensor? block_mask=None, float? softmax_scale=None, "
      "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "float dropout_p=0.0, Tensor? rng_state=None, bool deterministic=False, int algorithm=0, "
      "int block_size_q=0, int block_size_k=0, bool bhnd=False, int shard_q=-1, int shard_k=-1, "
      "Tensor? block_table=None, int num_splits=0, int sm_margin=0) "
      "-> (Tensor dq, Tensor dk, Tensor dv)",
      {at::Tag::pt2_compliant_tag});
  // k_cache and v_cache are written (the new rows, when k and v are given): mutable
  // arguments, so that functionalization and torch.compile order the writes
  m.def(
      "kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
      "Tensor? k=None, Tensor? v=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
      "Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, Tensor? block_table=None, "
      "Tensor? alibi_slopes=None, float? softmax_scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, float softcap=0.0, bool rotary_interleaved=True, "
      "int num_splits=0, int algorithm=0) -> (Tensor out, Tensor lse)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(flashattn, CPU, m) {
  m.impl("fwd", &fwd_kernel);
  m.impl("bwd", &bwd_kernel);
  m.impl("kvcache", &kvcache_kernel);
}

TORCH_LIBRARY_IMPL(flashattn, CUDA, m) {
  m.impl("fwd", &fwd_kernel);
  m.impl("bwd", &bwd_kernel);
  m.impl("kvcache", &kvcache_kernel);
}

TORCH_LIBRARY_IMPL(flashattn, Autograd, m) {
  m.impl("fwd", &fwd_autograd);
  // no double backward: a clear error if one is asked for
  m.impl("bwd", torch::autograd::autogradNotImplementedFallback());
  // inference only: a clear error if a gradient is asked for
  m.impl("kvcache", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(flashattn, ADInplaceOrView, m) {
  // the caches' version counters move with the write
  m.impl("kvcache", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}
