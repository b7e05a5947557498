#pragma once
// How an encoder is judged (docs/ssl.md): kNN and a linear probe on frozen features beside the
// random-encoder and raw-pixel floors, then label efficiency: class-balanced label subsets (fraction x
// seed, the same subsets in every cell), on which an SSL encoder is probed and fine-tuned, and a
// supervised cell's architecture is trained from scratch with its accuracy recorded along the way (so
// that the report can pick the best scratch run within the SSL path's measured compute).
// Evaluation runs in fp32 on rank 0, after training, and is timed apart from it.
#include <string>

#include "core/config.hpp"
#include "suites/models/data.hpp"
#include "suites/models/models.hpp"

namespace trainscope::suites::ssl {

// Weighted kNN (DINO's eval_knn, solo-learn): cosine similarity of L2-normalised features, the k
// nearest bank entries vote with weight exp(sim / temperature). Returns the accuracy on the queries.
double knn_accuracy(const torch::Tensor& bank, const torch::Tensor& bank_labels, const torch::Tensor& queries,
                    const torch::Tensor& query_labels, int64_t k, double temperature, int64_t classes);

// A linear classifier on standardised frozen features (BatchNorm without affine parameters, as MAE's
// probe), SGD with momentum 0.9 and a cosine schedule, `epochs` passes (at least 300 steps).
double linear_probe(const torch::Tensor& train_features, const torch::Tensor& train_labels,
                    const torch::Tensor& test_features, const torch::Tensor& test_labels, int64_t epochs,
                    int64_t seed, int64_t classes);

// Class-balanced subset of `labels` ([N] int64): round(fraction x count) indices of every class,
// drawn by `seed` alone (not the cell's seed), sorted.
torch::Tensor label_subset(const torch::Tensor& labels, double fraction, int64_t seed, int64_t classes);

// The encoder's features of `images` in eval mode, fp32, in chunks.
torch::Tensor extract_features(ReferenceModel& encoder, const torch::Tensor& images, const torch::Device& device);

struct EvalSetup {
  RunConfig config;
  ModelPreset preset;
  DataShape shape;
  std::string device = "cpu";
  std::string floors_cache;   // where the raw-pixel floor of this protocol is kept between cells ("": none)
  double pretrain_wall_s = 0;
};

// metrics.ssl's evaluation part (protocol, frozen, label_efficiency, eval_wall_s) for `encoder`, the
// trained one (an SSL method's eval encoder, or a supervised model). Null when ssl_eval is off.
json evaluate(ReferenceModel& encoder, DataSource& data, const EvalSetup& setup);

}  // namespace trainscope::suites::ssl
