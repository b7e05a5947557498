// The GPU timeline probe over CUPTI's Activity API (kernels and memcpys of the measured steps), built
// with the CUDA toolkit. CUPTI is opened at run time (the libcupti.so.13 LibTorch has loaded, else the
// toolkit's), so a machine without it, or without a driver, gets a section saying why and the cell
// runs on. Only the Activity API: no callback subscriber, whose one slot Kineto may hold; and a cell
// never runs this probe together with torch's profiler (each cell is its own process).
#include <cupti_activity.h>
#include <cupti_version.h>
#include <dlfcn.h>

#include <mutex>
#include <vector>

#include <torch/cuda.h>

#include "core/build_info.hpp"
#include "probes/device/gpu.hpp"
#include "probes/device/timeline.hpp"

namespace trainscope::probes {
namespace {

struct Cupti {
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  CUptiResult (*dropped)(CUcontext, uint32_t, size_t*) = nullptr;
  CUptiResult (*timestamp)(uint64_t*) = nullptr;
  CUptiResult (*version)(uint32_t*) = nullptr;
  CUptiResult (*result_string)(CUptiResult, const char**) = nullptr;

  // "" when every entry point was found.
  std::string open() {
    void* h = nullptr;
    const std::string toolkit = cuda_library_dir();
    for (const std::string& lib : {std::string("libcupti.so.13"), std::string("libcupti.so"),
                                   toolkit.empty() ? std::string() : toolkit + "/libcupti.so.13"}) {
      if (lib.empty()) continue;
      if ((h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
    }
    if (!h) return "CUPTI is not installed (libcupti.so.13 not found)";
    auto get = [h](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      return fn != nullptr;
    };
    if (!(get(register_callbacks, "cuptiActivityRegisterCallbacks") && get(enable, "cuptiActivityEnable") &&
          get(disable, "cuptiActivityDisable") && get(flush_all, "cuptiActivityFlushAll") &&
          get(next_record, "cuptiActivityGetNextRecord") && get(dropped, "cuptiActivityGetNumDroppedRecords") &&
          get(timestamp, "cuptiGetTimestamp") && get(version, "cuptiGetVersion") &&
          get(result_string, "cuptiGetResultString")))
      return "this libcupti lacks the Activity API entry points";
    return "";
  }
  std::string error(const char* what, CUptiResult r) const {
    const char* s = nullptr;
    if (result_string) result_string(r, &s);
    return std::string(what) + " failed: " + (s ? s : "CUPTI error " + std::to_string(static_cast<int>(r)));
  }
};

// CUPTI's buffer callbacks are process-wide; so is what they collect.
std::mutex g_mu;
std::vector<KernelRecord> g_records;
Cupti g_cupti;

void CUPTIAPI on_request(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = 8 << 20;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, kBytes));
  *size = kBytes;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI on_complete(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<KernelRecord> got;
  CUpti_Activity* r = nullptr;
  while (g_cupti.next_record(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(r);
      const std::string name = k->name ? k->name : "?";
      got.push_back({name, {static_cast<int64_t>(k->start), static_cast<int64_t>(k->end)}, k->streamId, classify_kernel(name)});
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(r);
      got.push_back({"Memcpy", {static_cast<int64_t>(m->start), static_cast<int64_t>(m->end)}, m->streamId, KernelKind::Memory});
    }
  }
  free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_records.insert(g_records.end(), got.begin(), got.end());
}

class CuptiTimelineProbe : public Probe {
 public:
  std::string name() const override { return "timeline"; }
  void run_begin(const RunInfo& info) override {
    if (info.device.rfind("cuda", 0) != 0) return fail("the cell runs on " + info.device);
    if (std::string why = g_cupti.open(); !why.empty()) return fail(why);
    uint32_t v = 0;
    if (g_cupti.version(&v) != CUPTI_SUCCESS) return fail("cuptiGetVersion failed (no driver?)");
    // The records are read with this build's struct layout (CUPTI 13's Kernel10 / Memcpy6).
    if (v / 10000 != CUPTI_API_VERSION / 10000)
      return fail("CUPTI " + std::to_string(v) + " at run time, built against " + std::to_string(CUPTI_API_VERSION));
    if (CUptiResult r = g_cupti.register_callbacks(on_request, on_complete); r != CUPTI_SUCCESS)
      return fail(g_cupti.error("cuptiActivityRegisterCallbacks", r));
    for (CUpti_ActivityKind k : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY})
      if (CUptiResult r = g_cupti.enable(k); r != CUPTI_SUCCESS) return fail(g_cupti.error("cuptiActivityEnable", r));
    enabled_ = true;
  }
  void step_begin(const StepInfo& s) override {
    if (!enabled_ || !s.measured || window_.start != 0) return;
    // Warm-up work still queued on the device must not fall into the window.
    torch::cuda::synchronize();
    uint64_t t = 0;
    g_cupti.timestamp(&t);
    window_.start = static_cast<int64_t>(t);
  }
  void step_end(const StepInfo& s) override {
    if (enabled_ && s.measured) ++steps_;
  }
  void run_end(const RunEnd&) override {
    if (!enabled_) return;
    torch::cuda::synchronize();
    uint64_t t = 0;
    g_cupti.timestamp(&t);
    window_.end = static_cast<int64_t>(t);
    g_cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    for (CUpti_ActivityKind k : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY}) g_cupti.disable(k);
    size_t dropped = 0;
    g_cupti.dropped(nullptr, 0, &dropped);
    std::vector<KernelRecord> records;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      records.swap(g_records);
    }
    section_ = timeline_section(summarize(records, window_), steps_, static_cast<int64_t>(dropped));
    enabled_ = false;
  }
  json section() const override { return section_; }

 private:
  void fail(const std::string& why) { section_ = json{{"available", false}, {"reason", why}}; }
  bool enabled_ = false;
  Interval window_;
  int64_t steps_ = 0;
  json section_ = json{{"available", false}, {"reason", "the run did not start"}};
};

}  // namespace

std::shared_ptr<Probe> make_timeline_probe() { return std::make_shared<CuptiTimelineProbe>(); }

}  // namespace trainscope::probes
