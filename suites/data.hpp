#pragma once
// Data sources: Fashion-MNIST from Debian's dataset-fashion-mnist, and deterministic synthetic
// images and tokens. Every batch is a pure function of (seed, step): reruns draw the same samples.
#include <memory>
#include <string>

#include "suites/models.hpp"

namespace trainscope::suites {

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual DataShape shape() const = 0;
  // Training batch number `step` (on CPU; the loop moves it to the device).
  virtual Batch train_batch(int64_t step, int64_t batch_size) = 0;
  // Held-out set for accuracy; empty tensors when the source has none.
  virtual Batch test_set() { return {}; }
  virtual std::string describe() const = 0;
};

// `data` is the config value; "auto" picks Fashion-MNIST for image models, tokens for GPT.
std::string resolve_data(const std::string& data, const ModelPreset& model);
std::unique_ptr<DataSource> make_data(const std::string& data, const ModelPreset& model, int64_t seed);

// Where Fashion-MNIST is read from: $TRAINSCOPE_FASHION_MNIST or Debian's location.
std::string fashion_mnist_dir();
bool fashion_mnist_available();

// Reads one gzipped IDX file (images: uint8 [N,H,W]; labels: uint8 [N]); throws on a bad file.
torch::Tensor read_idx_gz(const std::string& path);

}  // namespace trainscope::suites
