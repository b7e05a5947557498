// The accounting CPU allocator (memory.hpp), apart from the probe so that the small shared library
// tests/parity loads into Python (accounting_capi.cpp) can count PyTorch's tensors the same way.
#include "probes/step/memory.hpp"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <new>
#include <thread>

namespace trainscope::probes {
namespace {

std::atomic<int64_t> g_current{0}, g_peak{0}, g_phase_peak{0}, g_freed_elsewhere{0};
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_budget{0};
std::atomic<const char*> g_phase{"setup"};

void raise_to(std::atomic<int64_t>& target, int64_t value) {
  int64_t seen = target.load(std::memory_order_relaxed);
  while (value > seen && !target.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// Each block carries its size and the thread that allocated it in a 64-byte header in front of the
// data, so the deleter needs no lookup; the DataPtr's context is the data pointer itself, which torch's
// raw_allocate expects.
constexpr size_t kHeader = 64;
constexpr size_t kOwner = 8;  // offset of the allocating thread's id
static_assert(kOwner + sizeof(std::thread::id) <= kHeader);

void counted_delete(void* data) {
  if (!data) return;
  char* block = static_cast<char*>(data) - kHeader;
  const int64_t bytes = *reinterpret_cast<int64_t*>(block);
  if (*std::launder(reinterpret_cast<std::thread::id*>(block + kOwner)) != std::this_thread::get_id())
    g_freed_elsewhere.fetch_add(bytes, std::memory_order_relaxed);
  AccountingAllocator::on_free(bytes);
  c10::free_cpu(block);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const int64_t budget = g_budget.load(std::memory_order_relaxed);
    if (budget > 0) {
      const int64_t live = g_current.load(std::memory_order_relaxed);
      TORCH_CHECK_WITH(OutOfMemoryError, live + static_cast<int64_t>(n) <= budget,
                       "out of memory in ", g_phase.load(), ": asked for ", n, " bytes with ", live,
                       " live, budget ", budget, " bytes");
    }
    char* block = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<int64_t*>(block) = static_cast<int64_t>(n);
    new (block + kOwner) std::thread::id(std::this_thread::get_id());
    AccountingAllocator::on_alloc(static_cast<int64_t>(n));
    void* data = block + kHeader;
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator g_allocator;
constexpr uint8_t kPriority = 100;  // above the default allocator's priority (0)

}  // namespace

void AccountingAllocator::on_alloc(int64_t bytes) {
  const int64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  raise_to(g_peak, now);
  raise_to(g_phase_peak, now);
}
void AccountingAllocator::on_free(int64_t bytes) { g_current.fetch_sub(bytes, std::memory_order_relaxed); }

void AccountingAllocator::install() {
  if (g_installed.exchange(true)) return;
  c10::SetCPUAllocator(&g_allocator, kPriority);
}
void AccountingAllocator::uninstall() {
  if (!g_installed.exchange(false)) return;
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), kPriority);
}
void AccountingAllocator::set_budget(int64_t bytes) { g_budget.store(bytes); }
int64_t AccountingAllocator::budget() { return g_budget.load(); }
void AccountingAllocator::set_phase(const char* phase) { g_phase.store(phase); }
const char* AccountingAllocator::phase() { return g_phase.load(); }
bool AccountingAllocator::installed() { return g_installed.load(); }
int64_t AccountingAllocator::current() { return g_current.load(); }
int64_t AccountingAllocator::peak() { return g_peak.load(); }
int64_t AccountingAllocator::phase_peak() { return g_phase_peak.load(); }
int64_t AccountingAllocator::freed_elsewhere() { return g_freed_elsewhere.load(); }
void AccountingAllocator::reset_peak() { g_peak.store(g_current.load()); }
void AccountingAllocator::reset_phase_peak() { g_phase_peak.store(g_current.load()); }

}  // namespace trainscope::probes
