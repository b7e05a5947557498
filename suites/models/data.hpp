#pragma once
// Data sources: Fashion-MNIST from Debian's dataset-fashion-mnist, English text from Debian's
// fortunes (byte-level tokens), and deterministic synthetic images and tokens. Every batch is a pure function of (seed, step): reruns draw the same samples.
#include <memory>
#include <string>

#include "suites/models/models.hpp"

namespace trainscope::suites {

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual DataShape shape() const = 0;
  // Training batch number `step` (on CPU; the loop moves it to the device).
  virtual Batch train_batch(int64_t step, int64_t batch_size) = 0;
  // Held-out set for accuracy; empty tensors when the source has none.
  virtual Batch test_set() { return {}; }
  // The labelled training pool for evaluation protocols (kNN bank, probes, label subsets); empty when
  // the source has none. Independent of unlabeled_size.
  virtual Batch train_set() { return {}; }
  // Images the training stream draws from (0: unbounded, synthetic).
  virtual int64_t train_size() const { return 0; }
  virtual std::string describe() const = 0;
};

// `data` is the config value; "auto" picks Fashion-MNIST for image models, synthetic tokens for GPT,
// text for Llama.
std::string resolve_data(const std::string& data, const ModelPreset& model);
// unlabeled_size > 0: Fashion-MNIST's stream draws from the first N images of a fixed permutation (the
// same for every seed, so 6k is inside 30k is inside 60k).
std::unique_ptr<DataSource> make_data(const std::string& data, const ModelPreset& model, int64_t seed,
                                      int64_t unlabeled_size = 0);

// Fashion-MNIST's normalisation (the training set's mean and standard deviation).
inline constexpr double kPixelMean = 0.2860, kPixelStd = 0.3530;

// Where Fashion-MNIST is read from: $TRAINSCOPE_FASHION_MNIST or Debian's location.
std::string fashion_mnist_dir();
bool fashion_mnist_available();
// Where data = text reads its fortune files: $TRAINSCOPE_TEXT_DIR or Debian's location.
std::string text_dir();
bool text_available();

// Reads one gzipped IDX file (images: uint8 [N,H,W]; labels: uint8 [N]); throws on a bad file.
torch::Tensor read_idx_gz(const std::string& path);

}  // namespace trainscope::suites
