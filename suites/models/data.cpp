#include "suites/models/data.hpp"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/errors.hpp"

namespace trainscope::suites {
namespace {

torch::Generator generator(int64_t seed) { return at::detail::createCPUGenerator(static_cast<uint64_t>(seed)); }

// Mixes (seed, stream, index) into one generator seed so that streams never share draws.
int64_t mix(int64_t seed, int64_t stream, int64_t index) {
  uint64_t x = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(stream) * 0xBF58476D1CE4E5B9ull ^
               static_cast<uint64_t>(index) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<int64_t>(x & 0x7FFFFFFFFFFFull);
}

// ---- Fashion-MNIST -----------------------------------------------------------------------------
class FashionMnist : public DataSource {
 public:
  FashionMnist(int64_t seed, int64_t subset) : seed_(seed) {
    const std::string dir = fashion_mnist_dir();
    if (!fashion_mnist_available())
      throw MissingData("Fashion-MNIST not found in " + dir +
                        ": install Debian's package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)");
    train_x_ = read_idx_gz(dir + "/train-images-idx3-ubyte.gz");
    train_y_ = read_idx_gz(dir + "/train-labels-idx1-ubyte.gz").to(torch::kLong);
    test_x_ = read_idx_gz(dir + "/t10k-images-idx3-ubyte.gz");
    test_y_ = read_idx_gz(dir + "/t10k-labels-idx1-ubyte.gz").to(torch::kLong);
    if (train_x_.size(0) != train_y_.size(0) || test_x_.size(0) != test_y_.size(0))
      throw std::runtime_error("Fashion-MNIST in " + dir + ": image and label counts differ");
    if (subset > train_x_.size(0))
      throw UsageError("unlabeled_size " + std::to_string(subset) + " exceeds Fashion-MNIST's " +
                       std::to_string(train_x_.size(0)) + " training images");
    if (subset > 0) {
      // A seed-independent permutation: subsets of different sizes nest.
      auto g = generator(mix(0, 5, 0));
      subset_ = torch::randperm(train_x_.size(0), g, torch::kLong).narrow(0, 0, subset).contiguous();
    }
  }
  DataShape shape() const override { return {1, train_x_.size(1), train_x_.size(2), 10, 0, 0}; }
  Batch train_batch(int64_t step, int64_t batch_size) override {
    // Sample k of the stream is position k of the epoch's permutation (one permutation per epoch).
    const int64_t n = train_size();
    std::vector<int64_t> idx(static_cast<size_t>(batch_size));
    for (int64_t i = 0; i < batch_size; ++i) {
      const int64_t k = step * batch_size + i, epoch = k / n;
      if (epoch != epoch_) {
        auto g = generator(mix(seed_, 1, epoch));
        auto perm = torch::randperm(n, g, torch::kLong);
        perm_.assign(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n);
        epoch_ = epoch;
      }
      idx[static_cast<size_t>(i)] = perm_[static_cast<size_t>(k % n)];
    }
    auto index = torch::from_blob(idx.data(), {batch_size}, torch::kLong).clone();
    if (subset_.defined()) index = subset_.index_select(0, index);
    return {normalize(train_x_.index_select(0, index)), train_y_.index_select(0, index)};
  }
  Batch test_set() override { return {normalize(test_x_), test_y_}; }
  Batch train_set() override { return {normalize(train_x_), train_y_}; }
  int64_t train_size() const override { return subset_.defined() ? subset_.size(0) : train_x_.size(0); }
  std::string describe() const override { return "fashion-mnist (" + fashion_mnist_dir() + ")"; }

 private:
  // Standardised with the training set's mean and standard deviation (0.2860, 0.3530).
  static torch::Tensor normalize(const torch::Tensor& u8) {
    return ((u8.to(torch::kFloat) / 255.0 - kPixelMean) / kPixelStd).unsqueeze(1);
  }
  int64_t seed_;
  torch::Tensor train_x_, train_y_, test_x_, test_y_, subset_;
  std::vector<int64_t> perm_;
  int64_t epoch_ = -1;
};

// ---- synthetic images: a fixed template per class plus Gaussian noise -----------------------------
// Templates are smooth blobs (a 7x7 pattern upsampled) on a class-specific brightness, so both an MLP
// and a CNN with global pooling can learn them within tens of steps.
class SyntheticImages : public DataSource {
 public:
  SyntheticImages(int64_t seed, DataShape shape) : seed_(seed), shape_(shape) {
    auto g = generator(mix(seed, 2, 0));
    auto coarse = torch::randn({shape.classes, shape.channels, 7, 7}, g);
    auto level = torch::linspace(-1.0, 1.0, shape.classes).view({shape.classes, 1, 1, 1});
    templates_ = torch::nn::functional::interpolate(
                     coarse, torch::nn::functional::InterpolateFuncOptions()
                                 .size(std::vector<int64_t>{shape.height, shape.width})
                                 .mode(torch::kNearest)) +
                 level;
  }
  DataShape shape() const override { return shape_; }
  Batch train_batch(int64_t step, int64_t batch_size) override { return draw(mix(seed_, 3, step), batch_size); }
  Batch test_set() override { return draw(mix(seed_, 4, 0), 1024); }
  Batch train_set() override { return draw(mix(seed_, 6, 0), 4096); }
  std::string describe() const override { return "synthetic-images (class templates + noise)"; }

 private:
  Batch draw(int64_t stream_seed, int64_t n) {
    auto g = generator(stream_seed);
    auto labels = torch::randint(shape_.classes, {n}, g, torch::kLong);
    auto noise = torch::randn({n, shape_.channels, shape_.height, shape_.width}, g);
    return {templates_.index_select(0, labels) + noise, labels};
  }
  int64_t seed_;
  DataShape shape_;
  torch::Tensor templates_;
};

// ---- synthetic tokens: arithmetic progressions mod V with 10% random tokens ------------------------
// Predictable from two tokens of context, so a working model's loss falls well below log(V).
class SyntheticTokens : public DataSource {
 public:
  SyntheticTokens(int64_t seed, int64_t vocab, int64_t seq_len) : seed_(seed) {
    shape_.vocab = vocab;
    shape_.seq_len = seq_len;
  }
  DataShape shape() const override { return shape_; }
  Batch train_batch(int64_t step, int64_t batch_size) override {
    auto g = generator(mix(seed_, 5, step));
    const int64_t S = shape_.seq_len + 1, V = shape_.vocab;
    auto start = torch::randint(V, {batch_size, 1}, g, torch::kLong);
    auto stride = torch::randint(1, 8, {batch_size, 1}, g, torch::kLong);
    auto seq = (start + stride * torch::arange(S, torch::kLong).unsqueeze(0)).remainder(V);
    auto noise = torch::randint(V, {batch_size, S}, g, torch::kLong);
    auto flip = torch::rand({batch_size, S}, g) < 0.1;
    seq = torch::where(flip, noise, seq);
    return {seq.slice(1, 0, S - 1).contiguous(), seq.slice(1, 1, S).contiguous()};
  }
  std::string describe() const override { return "synthetic-tokens (progressions mod V, 10% noise)"; }

 private:
  int64_t seed_;
  DataShape shape_;
};

// ---- text: Debian's fortunes as byte-level tokens ---------------------------------------------------
// Every fortune file (the plain-text ones; not the .dat indexes or .u8 links) in name order, as one
// stream of bytes. A sample is a window of seq_len + 1 bytes at an offset drawn from (seed, step); the
// target is the window shifted by one. Tokens are bytes, so the model's vocabulary must hold 256.
class Text : public DataSource {
 public:
  Text(int64_t seed, int64_t vocab, int64_t seq_len) : seed_(seed) {
    shape_.vocab = vocab;
    shape_.seq_len = seq_len;
    if (vocab < 256)
      throw UsageError("data 'text' is byte-level: the model's vocab must be at least 256, not " + std::to_string(vocab));
    const std::string dir = text_dir();
    std::vector<std::filesystem::path> files;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec))
      if (e.is_regular_file() && !e.path().has_extension()) files.push_back(e.path());
    if (ec || files.empty())
      throw MissingData("data 'text': no fortune files in " + dir + ": install Debian's package fortunes (apt-get install fortunes)");
    std::sort(files.begin(), files.end());
    std::string bytes;
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      bytes.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    if (static_cast<int64_t>(bytes.size()) < 2 * (seq_len + 1))
      throw MissingData("data 'text': " + std::to_string(bytes.size()) + " bytes in " + dir + " is too little for seq_len " +
                        std::to_string(seq_len));
    // Kept as bytes (2.6 MB, not 8x that as int64): the data set counts in the cell's memory.
    corpus_ = torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8).clone();
    files_ = static_cast<int64_t>(files.size());
  }
  DataShape shape() const override { return shape_; }
  Batch train_batch(int64_t step, int64_t batch_size) override {
    auto g = generator(mix(seed_, 7, step));
    const int64_t S = shape_.seq_len + 1;
    const auto start = torch::randint(corpus_.size(0) - S, {batch_size, 1}, g, torch::kLong);
    const auto seq = corpus_.index_select(0, (start + torch::arange(S, torch::kLong).unsqueeze(0)).reshape({-1}))
                         .to(torch::kLong)
                         .view({batch_size, S});
    return {seq.slice(1, 0, S - 1).contiguous(), seq.slice(1, 1, S).contiguous()};
  }
  std::string describe() const override {
    return "text (" + std::to_string(corpus_.size(0)) + " bytes of English in " + std::to_string(files_) + " fortune files, " +
           text_dir() + ")";
  }

 private:
  int64_t seed_, files_ = 0;
  DataShape shape_;
  torch::Tensor corpus_;
};

}  // namespace

std::string text_dir() {
  const char* env = std::getenv("TRAINSCOPE_TEXT_DIR");
  return env && *env ? env : "/usr/share/games/fortunes";
}

bool text_available() {
  struct stat st {};
  return stat((text_dir() + "/fortunes").c_str(), &st) == 0;
}

std::string fashion_mnist_dir() {
  const char* env = std::getenv("TRAINSCOPE_FASHION_MNIST");
  return env && *env ? env : "/usr/share/datasets/fashion-mnist";
}

bool fashion_mnist_available() {
  struct stat st {};
  return stat((fashion_mnist_dir() + "/train-images-idx3-ubyte.gz").c_str(), &st) == 0;
}

torch::Tensor read_idx_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path);
  std::vector<unsigned char> bytes;
  unsigned char buf[1 << 16];
  int got = 0;
  while ((got = gzread(f, buf, sizeof buf)) > 0) bytes.insert(bytes.end(), buf, buf + got);
  const bool error = got < 0;
  gzclose(f);
  if (error) throw std::runtime_error(path + ": corrupt gzip data");
  auto be32 = [&](size_t at) {
    return (uint32_t(bytes[at]) << 24) | (uint32_t(bytes[at + 1]) << 16) | (uint32_t(bytes[at + 2]) << 8) |
           uint32_t(bytes[at + 3]);
  };
  // IDX header: two zero bytes, type 0x08 (unsigned byte), number of dimensions, then big-endian sizes.
  if (bytes.size() < 4 || bytes[0] != 0 || bytes[1] != 0 || bytes[2] != 0x08 || bytes[3] == 0 || bytes[3] > 4)
    throw std::runtime_error(path + ": not an unsigned-byte IDX file");
  const size_t dims = bytes[3], header = 4 + 4 * dims;
  if (bytes.size() < header) throw std::runtime_error(path + ": truncated IDX header");
  std::vector<int64_t> sizes;
  size_t count = 1;
  for (size_t d = 0; d < dims; ++d) {
    sizes.push_back(be32(4 + 4 * d));
    count *= static_cast<size_t>(sizes.back());
  }
  if (bytes.size() != header + count)
    throw std::runtime_error(path + ": expected " + std::to_string(count) + " values, found " +
                             std::to_string(bytes.size() - header));
  return torch::from_blob(bytes.data() + header, sizes, torch::kUInt8).clone();
}

std::string resolve_data(const std::string& data, const ModelPreset& model) {
  if (data != "auto") return data;
  if (model.family == "llama") return "text";  // today's decoders train on text
  return model.family == "gpt" ? "synthetic-tokens" : "fashion-mnist";
}

std::unique_ptr<DataSource> make_data(const std::string& data, const ModelPreset& model, int64_t seed,
                                      int64_t unlabeled_size) {
  const std::string kind = resolve_data(data, model);
  if (kind == "fashion-mnist") return std::make_unique<FashionMnist>(seed, unlabeled_size);
  if (kind == "synthetic-images") return std::make_unique<SyntheticImages>(seed, DataShape{1, 28, 28, 10, 0, 0});
  if (kind == "synthetic-tokens" || kind == "text") {
    if (!model.language_model())
      throw UsageError("data '" + kind + "' needs a language model (gpt, llama), not '" + model.name + "'");
    if (kind == "text") return std::make_unique<Text>(seed, model.vocab, model.seq_len);
    return std::make_unique<SyntheticTokens>(seed, model.vocab, model.seq_len);
  }
  throw UsageError("unknown data '" + data + "'");
}

}  // namespace trainscope::suites
