// A C interface to the accounting allocator, built as libtrainscope_accounting.so: the PyTorch-side
// parity references (tests/parity) load it with ctypes after `import torch`, so that PyTorch's tensor
// bytes are counted by the very allocator that counts ours (same libc10, same rule: bytes live in
// CPU tensor storage).
#include <cstdint>

#include "probes/step/memory.hpp"

using trainscope::probes::AccountingAllocator;

extern "C" {
void trainscope_accounting_install() { AccountingAllocator::install(); }
int64_t trainscope_accounting_current() { return AccountingAllocator::current(); }
int64_t trainscope_accounting_peak() { return AccountingAllocator::peak(); }
void trainscope_accounting_reset_peak() { AccountingAllocator::reset_peak(); }
}
