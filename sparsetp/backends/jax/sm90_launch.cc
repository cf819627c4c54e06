// XLA FFI handler that launches the Triton-compiled sm_90 attention kernels
// (sparsetp/kernels/hopper.py) on XLA's stream, built at run time by
// sparsetp/backends/jax/hopper.py. No Python runs per launch, and no torch: the cubin is loaded
// here (cuModuleLoadData, once per cubin and context) and the TMA descriptors are encoded per
// launch from the operands' addresses, as Triton's own launcher does.
//
// A plan holds what a launch needs besides the buffers: the cubin, the grid, the block and
// shared-memory sizes, and one entry per kernel parameter (a literal, an operand's pointer, or
// a TMA descriptor of an operand), in Triton 3.6's parameter packing (a descriptor is followed
// by its shape as i32 and its strides as i64; the last two parameters are the scratch
// pointers). Plans are registered from Python under a key that is a hash of their contents,
// and the custom call names its plan by that key: an executable from XLA's persistent cache
// finds the plan its trace registered in this process, never a stale address.
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Api {
  decltype(&cuStreamGetCtx) stream_get_ctx = nullptr;
  decltype(&cuCtxPushCurrent) ctx_push = nullptr;
  decltype(&cuCtxPopCurrent) ctx_pop = nullptr;
  decltype(&cuCtxGetDevice) ctx_get_device = nullptr;
  decltype(&cuModuleLoadData) module_load_data = nullptr;
  decltype(&cuModuleUnload) module_unload = nullptr;
  decltype(&cuModuleGetFunction) module_get_function = nullptr;
  decltype(&cuFuncGetAttribute) func_get_attribute = nullptr;
  decltype(&cuFuncSetAttribute) func_set_attribute = nullptr;
  decltype(&cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&cuTensorMapEncodeTiled) tensor_map_encode_tiled = nullptr;
  decltype(&cuLaunchKernelEx) launch_kernel_ex = nullptr;
  decltype(&cuGetErrorString) get_error_string = nullptr;
  bool ok = false;
};

const Api& api() {
  static Api a = [] {
    Api r;
    void* h = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!h) return r;
#define SYM(field, name) r.field = reinterpret_cast<decltype(r.field)>(dlsym(h, name))
    SYM(stream_get_ctx, "cuStreamGetCtx");
    SYM(ctx_push, "cuCtxPushCurrent_v2");
    SYM(ctx_pop, "cuCtxPopCurrent_v2");
    SYM(ctx_get_device, "cuCtxGetDevice");
    SYM(module_load_data, "cuModuleLoadData");
    SYM(module_unload, "cuModuleUnload");
    SYM(module_get_function, "cuModuleGetFunction");
    SYM(func_get_attribute, "cuFuncGetAttribute");
    SYM(func_set_attribute, "cuFuncSetAttribute");
    SYM(device_get_attribute, "cuDeviceGetAttribute");
    SYM(tensor_map_encode_tiled, "cuTensorMapEncodeTiled");
    SYM(launch_kernel_ex, "cuLaunchKernelEx");
    SYM(get_error_string, "cuGetErrorString");
#undef SYM
    r.ok = r.stream_get_ctx && r.ctx_push && r.ctx_pop && r.ctx_get_device &&
           r.module_load_data && r.module_unload && r.module_get_function && r.func_get_attribute &&
           r.func_set_attribute && r.device_get_attribute && r.tensor_map_encode_tiled &&
           r.launch_kernel_ex && r.get_error_string;
    return r;
  }();
  return a;
}

enum Kind : int32_t { kLit32 = 0, kLit64 = 1, kPointer = 2, kTma = 3 };

struct TmaSpec {
  int32_t operand;
  int64_t rows;        // of the [rows, d] view
  int64_t d;
  int32_t box_rows, box_cols;
  int32_t elem_type;   // host CUtensorMapDataType
  int32_t elem_size;
  int32_t swizzle;     // CUtensorMapSwizzle
};

struct Plan {
  std::string cubin, name;
  uint32_t grid[3];
  uint32_t block;
  uint32_t shared;
  std::vector<int32_t> kinds;
  std::vector<int64_t> values;  // literal, operand index or TMA slot
  std::vector<TmaSpec> tma;
  std::mutex mu;
  std::unordered_map<CUcontext, CUfunction> fn;  // by the context it was loaded in
};

ffi::Error cuda_error(CUresult r, const char* what) {
  const char* s = nullptr;
  api().get_error_string(r, &s);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("sparsetp sm_90 launch: ") + what + ": " + (s ? s : "?"));
}

// Modules by (kernel name, cubin) and CUDA context (a module belongs to the context it was
// loaded in): plans that differ only in grid or shapes share one loaded module per context
// instead of loading the cubin again for each.
std::mutex modules_mu;
std::map<std::pair<std::string, CUcontext>, CUfunction>& modules() {
  static auto* m = new std::map<std::pair<std::string, CUcontext>, CUfunction>();  // kept
  return *m;
}

// ``ctx`` is current (Launch pushed it).
ffi::Error load_function(const Plan& p, CUcontext ctx, CUdevice dev, CUfunction* out) {
  std::lock_guard<std::mutex> lock(modules_mu);
  auto key = std::make_pair(p.name + '\0' + p.cubin, ctx);
  auto it = modules().find(key);
  if (it != modules().end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  const Api& a = api();
  CUmodule mod;
  CUresult r = a.module_load_data(&mod, p.cubin.data());
  if (r != CUDA_SUCCESS) return cuda_error(r, "cuModuleLoadData");
  // A failure after the load unloads the module, so a launch retried after it loads no copy.
  auto fail = [&](CUresult err, const char* what) {
    a.module_unload(mod);
    return cuda_error(err, what);
  };
  CUfunction fn;
  r = a.module_get_function(&fn, mod, p.name.c_str());
  if (r != CUDA_SUCCESS) return fail(r, "cuModuleGetFunction");
  // As Triton's load_binary: dynamic shared memory up to the opt-in limit. The binary fixes
  // its shared memory, so every plan of one cubin asks the same.
  int optin = 0, static_shared = 0;
  r = a.device_get_attribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev);
  if (r != CUDA_SUCCESS) return fail(r, "cuDeviceGetAttribute");
  r = a.func_get_attribute(&static_shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn);
  if (r != CUDA_SUCCESS) return fail(r, "cuFuncGetAttribute");
  if (p.shared > 49152 && optin > 49152) {
    r = a.func_set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             optin - static_shared);
    if (r != CUDA_SUCCESS) return fail(r, "cuFuncSetAttribute");
  }
  modules()[key] = fn;
  *out = fn;
  return ffi::Error::Success();
}

ffi::Error function_of(Plan* p, CUcontext ctx, CUdevice dev, CUfunction* out) {
  std::lock_guard<std::mutex> lock(p->mu);  // then modules_mu: the only nesting of the two
  auto it = p->fn.find(ctx);
  if (it == p->fn.end()) {
    CUfunction fn;
    ffi::Error err = load_function(*p, ctx, dev, &fn);
    if (err.failure()) return err;
    it = p->fn.emplace(ctx, fn).first;
  }
  *out = it->second;
  return ffi::Error::Success();
}

std::mutex registry_mu;
std::unordered_map<int64_t, Plan*>& registry() {
  static auto* plans = new std::unordered_map<int64_t, Plan*>();  // never freed: plans live
  return *plans;                                                   // as long as executables
}

Plan* find_plan(int64_t key) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(key);
  return it == registry().end() ? nullptr : it->second;
}

ffi::Error Launch(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t key) {
  const Api& a = api();
  if (!a.ok) return ffi::Error(ffi::ErrorCode::kInternal, "libcuda.so.1 not usable");
  Plan* p = find_plan(key);
  if (!p)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sparsetp sm_90 launch: plan " + std::to_string(key) +
                          " is not registered in this process (it is registered when the "
                          "call is traced)");
  // As Triton's launcher, an empty grid launches nothing; that is only right where every
  // output is empty too (nothing would write them).
  if (static_cast<uint64_t>(p->grid[0]) * p->grid[1] * p->grid[2] == 0) {
    for (size_t i = 0; i < rets.size(); ++i) {
      auto b = rets.get<ffi::AnyBuffer>(i);
      if (b.has_error()) return b.error();
      if ((*b)->element_count() != 0)
        return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                          "sparsetp sm_90 launch: an empty grid with a non-empty output");
    }
    return ffi::Error::Success();
  }
  std::vector<void*> ptrs;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    ptrs.push_back(b.value().untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    ptrs.push_back((*b)->untyped_data());
  }
  for (void* q : ptrs) {
    if (reinterpret_cast<uintptr_t>(q) % 16)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "an operand is not 16-byte aligned");
  }
  CUcontext ctx;
  CUresult r = a.stream_get_ctx(stream, &ctx);
  if (r != CUDA_SUCCESS) return cuda_error(r, "cuStreamGetCtx");
  r = a.ctx_push(ctx);
  if (r != CUDA_SUCCESS) return cuda_error(r, "cuCtxPushCurrent");
  CUdevice dev;
  r = a.ctx_get_device(&dev);
  CUfunction fn = nullptr;
  ffi::Error err =
      r != CUDA_SUCCESS ? cuda_error(r, "cuCtxGetDevice") : function_of(p, ctx, dev, &fn);
  if (err.failure()) {
    CUcontext popped;
    a.ctx_pop(&popped);
    return err;
  }
  // Parameter storage: TMA descriptors 64-byte aligned, 8 bytes for every other value.
  std::vector<CUtensorMap> maps(p->tma.size());
  for (size_t s = 0; s < p->tma.size(); ++s) {
    const TmaSpec& t = p->tma[s];
    cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.d), static_cast<cuuint64_t>(t.rows)};
    cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.d * t.elem_size)};
    cuuint32_t box[2] = {static_cast<cuuint32_t>(t.box_cols),
                         static_cast<cuuint32_t>(t.box_rows)};
    cuuint32_t elem_strides[2] = {1, 1};
    r = a.tensor_map_encode_tiled(&maps[s], static_cast<CUtensorMapDataType>(t.elem_type), 2,
                                  ptrs[t.operand], dims, strides, box, elem_strides,
                                  CU_TENSOR_MAP_INTERLEAVE_NONE,
                                  static_cast<CUtensorMapSwizzle>(t.swizzle),
                                  CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      CUcontext popped;
      a.ctx_pop(&popped);
      return cuda_error(r, "cuTensorMapEncodeTiled");
    }
  }
  std::vector<int64_t> cells(p->kinds.size());
  std::vector<void*> params(p->kinds.size());
  for (size_t i = 0; i < p->kinds.size(); ++i) {
    switch (p->kinds[i]) {
      case kLit32:
      case kLit64:
        cells[i] = p->values[i];  // little-endian: an i32 / f32 is the low 4 bytes
        params[i] = &cells[i];
        break;
      case kPointer:
        cells[i] = reinterpret_cast<int64_t>(ptrs[p->values[i]]);
        params[i] = &cells[i];
        break;
      case kTma:
        params[i] = &maps[p->values[i]];
        break;
    }
  }
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof(config));
  config.gridDimX = p->grid[0];
  config.gridDimY = p->grid[1];
  config.gridDimZ = p->grid[2];
  config.blockDimX = p->block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = p->shared;
  config.hStream = stream;
  config.numAttrs = 0;
  config.attrs = nullptr;
  r = a.launch_kernel_ex(&config, fn, params.data(), nullptr);
  CUcontext popped;
  a.ctx_pop(&popped);
  if (r != CUDA_SUCCESS) return cuda_error(r, "cuLaunchKernelEx");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsetpSm90Launch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("plan"));

// Registers a plan under ``key`` (once: a key already there keeps its plan, the same one by
// construction). kinds/values: one per kernel parameter; tma: n_tma records of 8 int64s
// (operand, rows, d, box_rows, box_cols, elem_type, elem_size, swizzle).
extern "C" int32_t sparsetp_sm90_register(int64_t key, const char* cubin, int64_t cubin_size,
                                          const char* name,
                                          const int64_t* geometry /* grid xyz, block, shared */,
                                          int64_t n_params, const int32_t* kinds,
                                          const int64_t* values, int64_t n_tma,
                                          const int64_t* tma) {
  std::lock_guard<std::mutex> lock(registry_mu);
  if (registry().count(key)) return 0;
  Plan* p = new Plan();
  p->cubin.assign(cubin, static_cast<size_t>(cubin_size));
  p->name = name;
  for (int i = 0; i < 3; ++i) p->grid[i] = static_cast<uint32_t>(geometry[i]);
  p->block = static_cast<uint32_t>(geometry[3]);
  p->shared = static_cast<uint32_t>(geometry[4]);
  p->kinds.assign(kinds, kinds + n_params);
  p->values.assign(values, values + n_params);
  for (int64_t s = 0; s < n_tma; ++s) {
    const int64_t* t = tma + 8 * s;
    p->tma.push_back(TmaSpec{static_cast<int32_t>(t[0]), t[1], t[2], static_cast<int32_t>(t[3]),
                             static_cast<int32_t>(t[4]), static_cast<int32_t>(t[5]),
                             static_cast<int32_t>(t[6]), static_cast<int32_t>(t[7])});
  }
  registry()[key] = p;
  return 1;
}

// How many plans are registered (tests).
extern "C" int64_t sparsetp_sm90_plans() {
  std::lock_guard<std::mutex> lock(registry_mu);
  return static_cast<int64_t>(registry().size());
}

// How many (cubin, context) modules are loaded (tests).
extern "C" int64_t sparsetp_sm90_modules() {
  std::lock_guard<std::mutex> lock(modules_mu);
  return static_cast<int64_t>(modules().size());
}
