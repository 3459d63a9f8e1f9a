// flashattn._C: the Python entry to flashattn::fwd, flashattn::bwd and flashattn::kvcache
// for eager calls.
//
// torch.ops.flashattn.fwd(...) parses its arguments against the schema, boxes them and
// dispatches through the boxed path: more host time than a native torch function costs.
// fwd(), bwd() and kvcache() here take the schema's arguments positionally, as exact
// Python types, and call the operators through the dispatcher unboxed (autograd, tracing
// and dispatch modes still apply). Anything they do not take as is (a tensor subclass, an active
// __torch_function__ mode, another argument type) makes them return NotImplemented, and
// python/flashattn/_ops.py then calls torch.ops, which handles it (or raises the schema's
// error). Under torch.compile _ops.py calls torch.ops directly.
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/python_headers.h>

#include <tuple>

#include "torch_ops.h"

namespace {

using namespace flashattn_torch;

// ---- arguments: false means "not taken as is" ---------------------------------------

bool tensor_arg(PyObject *o, const Tensor **t) {
  if (!THPVariable_CheckExact(o)) return false;
  *t = &THPVariable_Unpack(o);
  return true;
}

bool optional_tensor_arg(PyObject *o, optional<Tensor> *t) {
  if (o == Py_None) return true;
  if (!THPVariable_CheckExact(o)) return false;
  *t = THPVariable_Unpack(o);
  return true;
}

bool double_arg(PyObject *o, double *d) {
  if (PyFloat_CheckExact(o)) {
    *d = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (PyLong_CheckExact(o)) {
    *d = PyLong_AsDouble(o);
    if (*d == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

bool optional_double_arg(PyObject *o, optional<double> *d) {
  if (o == Py_None) return true;
  double x = 0;
  if (!double_arg(o, &x)) return false;
  *d = x;
  return true;
}

bool bool_arg(PyObject *o, bool *b) {
  if (o != Py_True && o != Py_False) return false;
  *b = o == Py_True;
  return true;
}

bool int_arg(PyObject *o, int64_t *i) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *i = v;
  return true;
}

PyObject *not_taken() { Py_RETURN_NOTIMPLEMENTED; }

// The operator runs without the GIL, as torch's own functions do.
struct ReleaseGil {
  PyThreadState *state = PyEval_SaveThread();
  ReleaseGil() = default;
  ReleaseGil(const ReleaseGil &) = delete;
  ReleaseGil &operator=(const ReleaseGil &) = delete;
  ~ReleaseGil() { PyEval_RestoreThread(state); }
};

// An operator's tensors as a Python tuple.
template <typename... Ts>
PyObject *wrap(std::tuple<Ts...> &&r) {
  constexpr Py_ssize_t n = sizeof...(Ts);
  PyObject *t = PyTuple_New(n);
  if (!t) return nullptr;
  PyObject *items[n];
  Py_ssize_t i = 0;
  std::apply([&](auto &...x) { ((items[i++] = THPVariable_Wrap(std::move(x))), ...); }, r);
  bool ok = true;
  for (i = 0; i < n; i++) {
    PyTuple_SET_ITEM(t, i, items[i]);  // steals; NULL on failure
    ok = ok && items[i];
  }
  if (!ok) {
    Py_DECREF(t);
    return nullptr;
  }
  return t;
}

// args: cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_mask, softmax_scale,
// causal, window_left, window_right, softcap, dropout_p, rng_state, deterministic,
// algorithm, block_size_q, block_size_k, bhnd, shard_q, shard_k, block_table, num_splits,
// sm_margin
bool options_arg(PyObject *const *a, Options *o) {
  return optional_tensor_arg(a[0], &o->cu_seqlens_q) &&
         optional_tensor_arg(a[1], &o->cu_seqlens_k) && optional_tensor_arg(a[2], &o->seqused_k) &&
         optional_tensor_arg(a[3], &o->alibi_slopes) && optional_tensor_arg(a[4], &o->block_mask) &&
         optional_double_arg(a[5], &o->softmax_scale) && bool_arg(a[6], &o->causal) &&
         int_arg(a[7], &o->window_left) && int_arg(a[8], &o->window_right) &&
         double_arg(a[9], &o->softcap) && double_arg(a[10], &o->dropout_p) &&
         optional_tensor_arg(a[11], &o->rng_state) && bool_arg(a[12], &o->deterministic) &&
         int_arg(a[13], &o->algorithm) && int_arg(a[14], &o->block_size_q) &&
         int_arg(a[15], &o->block_size_k) && bool_arg(a[16], &o->bhnd) &&
         int_arg(a[17], &o->shard_q) && int_arg(a[18], &o->shard_k) &&
         optional_tensor_arg(a[19], &o->block_table) && int_arg(a[20], &o->num_splits) &&
         int_arg(a[21], &o->sm_margin);
}

constexpr Py_ssize_t kOptions = 22;

PyObject *fwd(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const Tensor *q = nullptr, *k = nullptr, *v = nullptr;
  Options o;
  if (nargs != 3 + kOptions || !tensor_arg(args[0], &q) || !tensor_arg(args[1], &k) ||
      !tensor_arg(args[2], &v) || !options_arg(args + 3, &o) ||
      at::impl::torch_function_mode_enabled())
    return not_taken();
  Tensors3 r;
  {
    ReleaseGil nogil;
    r = fwd_op().call(*q, *k, *v, o.cu_seqlens_q, o.cu_seqlens_k, o.seqused_k, o.alibi_slopes,
                      o.block_mask, o.softmax_scale, o.causal, o.window_left, o.window_right,
                      o.softcap, o.dropout_p, o.rng_state, o.deterministic, o.algorithm,
                      o.block_size_q, o.block_size_k, o.bhnd, o.shard_q, o.shard_k, o.block_table,
                      o.num_splits, o.sm_margin);
  }
  return wrap(std::move(r));
  END_HANDLE_TH_ERRORS
}

PyObject *bwd(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const Tensor *t[6] = {};
  Options o;
  if (nargs != 6 + kOptions) return not_taken();
  for (int i = 0; i < 6; i++)
    if (!tensor_arg(args[i], &t[i])) return not_taken();
  if (!options_arg(args + 6, &o) || at::impl::torch_function_mode_enabled()) return not_taken();
  Tensors3 r;
  {
    ReleaseGil nogil;
    r = bwd_op().call(*t[0], *t[1], *t[2], *t[3], *t[4], *t[5], o.cu_seqlens_q, o.cu_seqlens_k,
                      o.seqused_k, o.alibi_slopes, o.block_mask, o.softmax_scale, o.causal,
                      o.window_left, o.window_right, o.softcap, o.dropout_p, o.rng_state,
                      o.deterministic, o.algorithm, o.block_size_q, o.block_size_k, o.bhnd,
                      o.shard_q, o.shard_k, o.block_table, o.num_splits, o.sm_margin);
  }
  return wrap(std::move(r));
  END_HANDLE_TH_ERRORS
}

// args: q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, cache_batch_idx,
// cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_left,
// window_right, softcap, rotary_interleaved, num_splits, algorithm
PyObject *kvcache(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const Tensor *t[4] = {};
  optional<Tensor> opt[8];
  optional<double> scale;
  bool causal = false, interleaved = true;
  int64_t left = -1, right = -1, splits = 0, algorithm = 0;
  double softcap = 0;
  if (nargs != 20) return not_taken();
  for (int i = 0; i < 4; i++)
    if (!tensor_arg(args[i], &t[i])) return not_taken();
  for (int i = 0; i < 8; i++)
    if (!optional_tensor_arg(args[4 + i], &opt[i])) return not_taken();
  if (!optional_double_arg(args[12], &scale) || !bool_arg(args[13], &causal) ||
      !int_arg(args[14], &left) || !int_arg(args[15], &right) || !double_arg(args[16], &softcap) ||
      !bool_arg(args[17], &interleaved) || !int_arg(args[18], &splits) ||
      !int_arg(args[19], &algorithm) || at::impl::torch_function_mode_enabled())
    return not_taken();
  std::tuple<Tensor, Tensor> r;
  {
    ReleaseGil nogil;
    r = kvcache_op().call(*t[0], *t[1], *t[2], *t[3], opt[0], opt[1], opt[2], opt[3], opt[4],
                          opt[5], opt[6], opt[7], scale, causal, left, right, softcap, interleaved,
                          splits, algorithm);
  }
  return wrap(std::move(r));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"fwd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fwd)), METH_FASTCALL,
     "flashattn::fwd with the schema's 24 arguments, positionally; NotImplemented if it "
     "does not take them as they are."},
    {"bwd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&bwd)), METH_FASTCALL,
     "flashattn::bwd with the schema's 27 arguments, positionally; NotImplemented if it "
     "does not take them as they are."},
    {"kvcache", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&kvcache)),
     METH_FASTCALL,
     "flashattn::kvcache with the schema's 20 arguments, positionally; NotImplemented if it "
     "does not take them as they are."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "flashattn._C",
    "flashattn's PyTorch operators (flashattn::fwd, flashattn::bwd, flashattn::kvcache).",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
