#pragma once
// The one place where LibTorch 1.13 (Debian, CPU) and LibTorch 2.x (CUDA wheels) differ for us.
// Everything else in the code base calls these names only.
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#define TRAINSCOPE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// c10::Allocator::allocate is const up to 2.2 and non-const (with a pure virtual copy_data) from 2.3.
#if TRAINSCOPE_TORCH_AT_LEAST(2, 3)
#define TRAINSCOPE_ALLOCATE_CONST
#define TRAINSCOPE_ALLOCATOR_COPY_DATA                                              \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    default_copy_data(dest, src, count);                                           \
  }
#else
#define TRAINSCOPE_ALLOCATE_CONST const
#define TRAINSCOPE_ALLOCATOR_COPY_DATA
#endif

namespace trainscope::compat {

// The fused AMP ops (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_) have CPU kernels
// from 2.4 on; 1.13 has them for CUDA only.
inline bool amp_kernels_on(c10::DeviceType d) {
#if TRAINSCOPE_TORCH_AT_LEAST(2, 4)
  return d == c10::DeviceType::CPU || d == c10::DeviceType::CUDA;
#else
  return d == c10::DeviceType::CUDA;
#endif
}

inline bool autocast_enabled(c10::DeviceType d) {
#if TRAINSCOPE_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType d) {
#if TRAINSCOPE_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                   : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast(c10::DeviceType d, bool enabled, at::ScalarType dtype) {
#if TRAINSCOPE_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(d, dtype);
  at::autocast::set_autocast_enabled(d, enabled);
#else
  if (d == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  }
#endif
}

// Autocast for one forward pass, like Python's `torch.autocast` context manager. On exit it restores
// the previous state and, when the outermost autocast region closes, clears the cast cache: without
// that, Debian's 1.13 keeps bf16 copies of weights across optimizer steps and the next forward uses
// stale values.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, at::ScalarType dtype, bool enabled = true)
      : device_(device), active_(enabled) {
    if (!active_) return;
    prev_enabled_ = autocast_enabled(device_);
    prev_dtype_ = autocast_dtype(device_);
    set_autocast(device_, true, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    set_autocast(device_, prev_enabled_, prev_dtype_);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool active_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

}  // namespace trainscope::compat

namespace trainscope::compat {

// c10d: in 1.13 ProcessGroupGloo/NCCL are themselves c10d::ProcessGroups; in 2.x they are Backends
// that a dispatching ProcessGroup wraps (whose constructor later lost its Options argument: chosen by
// a trait). A template, so that only the file that includes the c10d headers instantiates it.
template <typename ProcessGroup, typename Backend, typename Store>
c10::intrusive_ptr<ProcessGroup> as_process_group(const c10::intrusive_ptr<Backend>& backend,
                                                  const c10::intrusive_ptr<Store>& store, int rank, int size,
                                                  bool nccl) {
#if TRAINSCOPE_TORCH_AT_LEAST(2, 0)
  const auto type = nccl ? ProcessGroup::BackendType::NCCL : ProcessGroup::BackendType::GLOO;
  c10::intrusive_ptr<ProcessGroup> pg;
  if constexpr (std::is_constructible_v<ProcessGroup, c10::intrusive_ptr<Store>, int, int>)
    pg = c10::make_intrusive<ProcessGroup>(store, rank, size);
  else
    pg = c10::make_intrusive<ProcessGroup>(
        store, rank, size, c10::make_intrusive<typename ProcessGroup::Options>(nccl ? "nccl" : "gloo"));
  pg->setBackend(nccl ? c10::DeviceType::CUDA : c10::DeviceType::CPU, type, backend);
  pg->setDefaultBackend(type);
  return pg;
#else
  (void)store, (void)rank, (void)size, (void)nccl;
  return backend;
#endif
}

}  // namespace trainscope::compat

namespace trainscope::compat {

// c10d::Reducer's constructor: 1.13 takes per-bucket size limits after the bucket indices; later
// versions dropped them and, later still, added flags (skip_all_reduce_unused_params,
// use_python_reducer, then a per-bucket cap list and batched_grad_copy). Chosen by a trait on the
// constructor rather than by version number. A template, so that only its user includes reducer.hpp.
template <typename Reducer, typename ProcessGroupPtr>
std::unique_ptr<Reducer> make_reducer(std::vector<at::Tensor> params, std::vector<std::vector<size_t>> indices,
                                      std::vector<size_t> limits, ProcessGroupPtr pg, std::vector<bool> sparse,
                                      int64_t cap, bool find_unused, bool as_view,
                                      std::unordered_map<size_t, std::string> names, int64_t first_cap) {
  using P = std::vector<at::Tensor>;
  using I = std::vector<std::vector<size_t>>;
  using S = std::vector<bool>;
  using N = std::unordered_map<size_t, std::string>;
  if constexpr (std::is_constructible_v<Reducer, P, I, std::vector<size_t>, ProcessGroupPtr, S, int64_t, bool, bool, N,
                                        int64_t>) {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(limits), std::move(pg),
                                     std::move(sparse), cap, find_unused, as_view, std::move(names), first_cap);
  } else if constexpr (std::is_constructible_v<Reducer, P, I, ProcessGroupPtr, S, int64_t, bool, bool, N, int64_t>) {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(pg), std::move(sparse), cap,
                                     find_unused, as_view, std::move(names), first_cap);
  } else if constexpr (std::is_constructible_v<Reducer, P, I, ProcessGroupPtr, S, int64_t, bool, bool, N, int64_t,
                                               bool, bool>) {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(pg), std::move(sparse), cap,
                                     find_unused, as_view, std::move(names), first_cap, false, false);
  } else {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(pg), std::move(sparse), cap,
                                     find_unused, as_view, std::move(names), first_cap, false, false,
                                     std::vector<int64_t>{}, false);
  }
}

}  // namespace trainscope::compat
