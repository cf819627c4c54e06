// The eager CUDA attention call with its autograd node and kernel launches in C++
// (sparsetp.backends.torch.native builds this file and documents it).
//
// Python builds, for one checked call signature (layout, shapes, strides, dtypes, device,
// options), the three launch descriptions and Triton's compiled kernels as usual, then hands
// this file a Plan: per kernel its CUfunction, grid, block and shared memory, and every kernel
// parameter's value (8-byte cells, little-endian, as cuLaunchKernel reads them) except the
// per-call tensor pointers, whose cells are filled at each launch. Forward and backward then
// run with no Python: a Python autograd.Function plus Triton's Python launcher cost more host
// time than a whole dense SDPA forward + backward (benchmarks/KERNEL_NOTES.md, host time).
//
// Needs only torch's headers and libraries: the CUDA driver is reached through dlopen, the
// current stream through c10's device-generic stream API, so it also builds on CPU machines.

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace sparsetp_native {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// ------------------------------------------------------------------ CUDA driver, by dlopen
typedef int CUresult;
typedef CUresult (*LaunchKernelFn)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, unsigned shared, void* stream,
                                   void** params, void** extra);
typedef CUresult (*GetErrorStringFn)(CUresult, const char**);
typedef CUresult (*CtxGetCurrentFn)(void**);
typedef CUresult (*DeviceGetFn)(int*, int);
typedef CUresult (*PrimaryCtxRetainFn)(void**, int);
typedef CUresult (*CtxSetCurrentFn)(void*);
// CUtensorMap: 128 opaque bytes, 64-byte aligned; the enums are C ints.
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};
typedef CUresult (*TensorMapEncodeTiledFn)(TensorMap*, int dtype, unsigned rank, void* address,
                                           const uint64_t* dims, const uint64_t* strides,
                                           const unsigned* box, const unsigned* element_strides,
                                           int interleave, int swizzle, int l2_promotion,
                                           int oob_fill);

struct Driver {
  LaunchKernelFn launch = nullptr;
  GetErrorStringFn error_string = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
  DeviceGetFn device_get = nullptr;
  PrimaryCtxRetainFn primary_ctx_retain = nullptr;
  CtxSetCurrentFn ctx_set_current = nullptr;
  TensorMapEncodeTiledFn encode_tiled = nullptr;  // CUDA 12+ drivers
};

const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "sparsetp native: cannot open libcuda.so.1: ", dlerror());
    out.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    out.error_string = reinterpret_cast<GetErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    out.ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
    out.device_get = reinterpret_cast<DeviceGetFn>(dlsym(lib, "cuDeviceGet"));
    out.primary_ctx_retain =
        reinterpret_cast<PrimaryCtxRetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain_v2"));
    out.ctx_set_current = reinterpret_cast<CtxSetCurrentFn>(dlsym(lib, "cuCtxSetCurrent"));
    out.encode_tiled =
        reinterpret_cast<TensorMapEncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    TORCH_CHECK(out.launch != nullptr, "sparsetp native: no cuLaunchKernel in libcuda.so.1");
    return out;
  }();
  return d;
}

// ------------------------------------------------------------------ one kernel's launch
constexpr size_t kMaxParams = 160;
constexpr size_t kMaxTma = 8;

// A TMA descriptor parameter (the sm_90 kernels): encoded at each launch from a per-call
// tensor's address, as Triton's launcher does (sparsetp.kernels.hopper.parameters).
struct Tma {
  int cell = 0, tensor = 0;
  int64_t rows = 0, d = 0;  // the tensor's [rows, d] contiguous view
  unsigned box_rows = 0, box_cols = 0;
  int elem_type = 0, elem_size = 0, swizzle = 0;  // CUtensorMapDataType, bytes, swizzle
};

struct Kernel {
  void* function = nullptr;  // CUfunction of a Triton CompiledKernel (loaded, attributes set)
  unsigned grid[3] = {0, 0, 0};
  unsigned threads = 0;
  unsigned shared = 0;
  std::vector<uint64_t> cells;                  // every parameter's value
  std::vector<std::pair<int, int>> per_call;    // (cell, tensor index) filled at each launch
  std::vector<Tma> tma;                         // descriptor cells, encoded at each launch

  Kernel() = default;
  Kernel(uint64_t fn, std::vector<int64_t> grid_, int64_t threads_, int64_t shared_,
         std::vector<uint64_t> cells_, std::vector<std::pair<int, int>> per_call_,
         const std::vector<std::vector<int64_t>>& tma_)
      : function(reinterpret_cast<void*>(fn)),
        threads(static_cast<unsigned>(threads_)),
        shared(static_cast<unsigned>(shared_)),
        cells(std::move(cells_)),
        per_call(std::move(per_call_)) {
    TORCH_CHECK(grid_.size() == 3, "sparsetp native: grid needs 3 dimensions");
    TORCH_CHECK(cells.size() <= kMaxParams, "sparsetp native: ", cells.size(),
                " kernel parameters, at most ", kMaxParams);
    TORCH_CHECK(tma_.size() <= kMaxTma, "sparsetp native: ", tma_.size(),
                " TMA descriptors, at most ", kMaxTma);
    for (int i = 0; i < 3; ++i) grid[i] = static_cast<unsigned>(grid_[i]);
    for (const auto& [cell, tensor] : per_call) {
      TORCH_CHECK(cell >= 0 && static_cast<size_t>(cell) < cells.size() && tensor >= 0,
                  "sparsetp native: per-call cell out of range");
    }
    for (const auto& t : tma_) {
      TORCH_CHECK(t.size() == 9, "sparsetp native: a TMA entry has 9 fields");
      Tma m;
      m.cell = static_cast<int>(t[0]);
      m.tensor = static_cast<int>(t[1]);
      m.rows = t[2];
      m.d = t[3];
      m.box_rows = static_cast<unsigned>(t[4]);
      m.box_cols = static_cast<unsigned>(t[5]);
      m.elem_type = static_cast<int>(t[6]);
      m.elem_size = static_cast<int>(t[7]);
      m.swizzle = static_cast<int>(t[8]);
      // The descriptor's cell, then its shape (2) and strides (2): all literal cells.
      TORCH_CHECK(m.cell >= 0 && static_cast<size_t>(m.cell) + 4 < cells.size() &&
                      m.tensor >= 0 && m.rows > 0 && m.d > 0 && m.elem_size > 0,
                  "sparsetp native: TMA entry out of range");
      for (const auto& [cell, tensor] : per_call) {
        TORCH_CHECK(cell < m.cell || cell > m.cell + 4,
                    "sparsetp native: a TMA cell is also a per-call pointer cell");
      }
      tma.push_back(m);
    }
    // Found here, where the plan is built (and the call falls back with a warning), rather
    // than at a launch.
    TORCH_CHECK(tma.empty() || driver().encode_tiled != nullptr,
                "sparsetp native: this CUDA driver has no cuTensorMapEncodeTiled");
  }

  void check_tensors(size_t count) const {
    for (const auto& [cell, tensor] : per_call) {
      TORCH_CHECK(static_cast<size_t>(tensor) < count, "sparsetp native: per-call tensor ",
                  tensor, " of a launch with ", count);
    }
    for (const auto& t : tma) {
      TORCH_CHECK(static_cast<size_t>(t.tensor) < count, "sparsetp native: TMA tensor ",
                  t.tensor, " of a launch with ", count);
    }
  }

  void launch(const std::vector<const at::Tensor*>& tensors, void* stream) const {
    uint64_t values[kMaxParams];
    void* params[kMaxParams];
    TensorMap maps[kMaxTma];
    std::memcpy(values, cells.data(), cells.size() * sizeof(uint64_t));
    for (const auto& [cell, tensor] : per_call) {
      values[cell] = reinterpret_cast<uint64_t>(tensors[tensor]->data_ptr());
    }
    for (size_t i = 0; i < cells.size(); ++i) params[i] = &values[i];
    const Driver& d = driver();
    for (size_t s = 0; s < tma.size(); ++s) {
      const Tma& t = tma[s];
      const at::Tensor& x = *tensors[t.tensor];
      // The plan's key fixes shapes; this guards the descriptor against a mismatched tensor.
      TORCH_CHECK(x.numel() == t.rows * t.d && x.is_contiguous() && x.element_size() == t.elem_size,
                  "sparsetp native: a TMA operand is not the planned contiguous [", t.rows,
                  ", ", t.d, "] view");
      TORCH_CHECK(d.encode_tiled != nullptr,
                  "sparsetp native: this driver has no cuTensorMapEncodeTiled");
      const uint64_t dims[2] = {static_cast<uint64_t>(t.d), static_cast<uint64_t>(t.rows)};
      const uint64_t strides[1] = {static_cast<uint64_t>(t.d * t.elem_size)};
      const unsigned box[2] = {t.box_cols, t.box_rows};
      const unsigned element_strides[2] = {1, 1};
      // No interleave, 128-byte L2 promotion, zero fill out of bounds: Triton's choices.
      const CUresult rc = d.encode_tiled(&maps[s], t.elem_type, 2, x.data_ptr(), dims, strides,
                                         box, element_strides, 0, t.swizzle, 2, 0);
      if (rc != 0) {
        const char* what = "unknown error";
        if (d.error_string != nullptr) d.error_string(rc, &what);
        TORCH_CHECK(false, "sparsetp native: cuTensorMapEncodeTiled failed (", rc, "): ", what);
      }
      params[t.cell] = &maps[s];
    }
    const CUresult rc = d.launch(function, grid[0], grid[1], grid[2], threads, 1, 1, shared,
                                 stream, params, nullptr);
    if (rc != 0) {
      const char* what = "unknown error";
      if (d.error_string != nullptr) d.error_string(rc, &what);
      TORCH_CHECK(false, "sparsetp native: cuLaunchKernel failed (", rc, "): ", what);
    }
  }
};

// A host thread whose first CUDA work is this call has no current driver context (the
// runtime binds one lazily; Triton's launcher calls ensureCudaContext for the same reason).
void ensure_context(const at::Tensor& like) {
  const Driver& d = driver();
  if (d.ctx_get_current == nullptr) return;
  void* ctx = nullptr;
  if (d.ctx_get_current(&ctx) == 0 && ctx != nullptr) return;
  int dev = 0;
  TORCH_CHECK(d.device_get(&dev, like.device().index()) == 0 &&
                  d.primary_ctx_retain(&ctx, dev) == 0 && d.ctx_set_current(ctx) == 0,
              "sparsetp native: no CUDA context for ", like.device());
}

void* current_stream(const at::Tensor& like) {
  const c10::impl::VirtualGuardImpl guard(like.device().type());
  return guard.getStream(like.device()).native_handle();
}

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// ``t`` with the strides (and 16-byte alignment) the kernels were built for: an output
// gradient of other strides, or a saved tensor that a saved-tensor hook gave back in another
// layout (save_on_cpu packs contiguously), is copied.
at::Tensor as_planned(const at::Tensor& t, c10::IntArrayRef strides) {
  if (t.strides() == strides && aligned(t)) return t;
  at::Tensor fresh = at::empty_strided(t.sizes(), strides, t.options());
  fresh.copy_(t);
  return fresh;
}

// ------------------------------------------------------------------ the plan of one call key
struct Plan {
  Kernel fwd, dq, dkdv;
  bool lse_double = false;  // the statistics dtype: float64 for float64 inputs, else float32
  std::vector<int64_t> d_out_strides;  // the strides the backward kernels were built for
  std::vector<std::vector<int64_t>> saved_strides;  // q, k, v, out, lse, likewise
  // The layout's metadata tensors, whose raw pointers sit in the cells: a pending backward
  // keeps them alive even when Python drops the layout and its caches.
  std::vector<at::Tensor> keep;

  at::Tensor new_lse(const at::Tensor& q) const {
    return at::empty({q.size(0), q.size(1), q.size(2)},
                     q.options().dtype(lse_double ? at::kDouble : at::kFloat));
  }
};

// ------------------------------------------------------------------ the autograd node
struct SparseAttentionBackward : public Node {
  std::shared_ptr<const Plan> plan;
  SavedVariable q_, k_, v_, out_, lse_;

  std::string name() const override { return "SparseAttentionBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    q_.reset_data();
    k_.reset_data();
    v_.reset_data();
    out_.reset_data();
    lse_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(!torch::autograd::GradMode::is_enabled(),
                "sparse_attention has no double backward (create_graph=True)");
    std::lock_guard<std::mutex> lock(mutex_);  // as generated nodes: saved variables are shared
    at::Tensor d_out = grads[0];
    const auto& st = plan->saved_strides;
    const at::Tensor q = as_planned(q_.unpack(), st[0]), k = as_planned(k_.unpack(), st[1]),
                     v = as_planned(v_.unpack(), st[2]);
    const at::Tensor out = as_planned(out_.unpack(getptr()), st[3]),
                     lse = as_planned(lse_.unpack(getptr()), st[4]);
    if (!d_out.defined()) d_out = at::zeros(out.sizes(), out.options());  // as the Python path
    // Any other gradient layout (a broadcast from .sum(), a transposed view) is copied.
    d_out = as_planned(d_out, plan->d_out_strides);
    at::Tensor delta = at::empty(lse.sizes(), lse.options());
    at::Tensor dq = at::empty(q.sizes(), q.options());
    at::Tensor dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    ensure_context(q);
    void* stream = current_stream(q);
    // dQ also writes delta = rowsum(dO * O), which dK/dV reads (the third lse slot is the
    // absent LSE cotangent's, as in the Python path).
    plan->dq.launch({&q, &k, &v, &d_out, &lse, &out, &lse, &dq, &delta}, stream);
    plan->dkdv.launch({&q, &k, &v, &d_out, &lse, &delta, &dk, &dv}, stream);
    return {dq, dk, dv};
  }
};

#if __has_include(<torch/csrc/autograd/node.h>)  // torch >= 2.13: nodes are intrusive_ptr
c10::intrusive_ptr<SparseAttentionBackward> new_node() {
  return c10::make_intrusive<SparseAttentionBackward>();
}
#else
std::shared_ptr<SparseAttentionBackward> new_node() {
  return std::shared_ptr<SparseAttentionBackward>(new SparseAttentionBackward(),
                                                  torch::autograd::deleteNode);
}
#endif

// (out, lse) of one call; ``out`` carries the backward node when q, k or v needs a gradient.
// The caller (sparsetp.backends.torch.attention) has checked the call against the plan's key.
std::vector<at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::shared_ptr<const Plan>& plan) {
  TORCH_CHECK(!(torch::autograd::isFwGradDefined(q) || torch::autograd::isFwGradDefined(k) ||
                torch::autograd::isFwGradDefined(v)),
              "sparse_attention has no forward-mode AD (jvp)");
  ensure_context(q);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = plan->new_lse(q);
  plan->fwd.launch({&q, &k, &v, &out, &lse}, current_stream(q));
  if (torch::autograd::compute_requires_grad(q, k, v)) {
    auto node = new_node();
    node->plan = plan;
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
    torch::autograd::set_history(out, node);
    node->q_ = SavedVariable(q, false);
    node->k_ = SavedVariable(k, false);
    node->v_ = SavedVariable(v, false);
    node->out_ = SavedVariable(out, true);
    node->lse_ = SavedVariable(lse, false);
  }
  return {out, lse};
}

}  // namespace sparsetp_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace sparsetp_native;
  m.doc() = "sparsetp's eager CUDA attention: autograd node and launches in C++";
  py::class_<Kernel>(m, "Kernel")
      .def(py::init<uint64_t, std::vector<int64_t>, int64_t, int64_t, std::vector<uint64_t>,
                    std::vector<std::pair<int, int>>, const std::vector<std::vector<int64_t>>&>(),
           py::arg("function"), py::arg("grid"), py::arg("threads"), py::arg("shared"),
           py::arg("cells"), py::arg("per_call"),
           py::arg("tma") = std::vector<std::vector<int64_t>>());
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def(py::init([](Kernel fwd, Kernel dq, Kernel dkdv, bool lse_double,
                       std::vector<int64_t> d_out_strides,
                       std::vector<std::vector<int64_t>> saved_strides,
                       std::vector<at::Tensor> keep) {
             TORCH_CHECK(saved_strides.size() == 5, "sparsetp native: 5 saved strides");
             fwd.check_tensors(5);   // the per-call tensor lists of attention() and apply()
             dq.check_tensors(9);
             dkdv.check_tensors(8);
             auto p = std::make_shared<Plan>();
             p->fwd = std::move(fwd);
             p->dq = std::move(dq);
             p->dkdv = std::move(dkdv);
             p->lse_double = lse_double;
             p->d_out_strides = std::move(d_out_strides);
             p->saved_strides = std::move(saved_strides);
             p->keep = std::move(keep);
             return p;
           }),
           py::arg("fwd"), py::arg("dq"), py::arg("dkdv"), py::arg("lse_double"),
           py::arg("d_out_strides"), py::arg("saved_strides"), py::arg("keep"));
  m.def("attention",
        [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const std::shared_ptr<Plan>& plan) { return attention(q, k, v, plan); },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("plan"));
}
