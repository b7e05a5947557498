#pragma once
// SSL health probe: is the representation collapsing? Sampled at the loss curve's points, on the
// embeddings the method's loss acted on (EmbeddingSample), each number beside its collapsed value:
//  - std of the L2-normalised embeddings per dimension, averaged (lightly's std_of_l2_normalized):
//    about 1/sqrt(d) when spread over the sphere, 0 when every sample maps to one point;
//  - RankMe, exp(entropy of the normalised singular values) of the embedding batch: its effective
//    rank, from d (isotropic) down to 1 (one direction);
//  - the loss against its value at collapse (SimCLR ln(2N-1), DINO ln K);
//  - DINO: the teacher's entropy h(P_t) and KL(P_t || P_s) (the DINO paper's collapse monitors: KL
//    reaches 0 under either form of collapse).
// The verdict is `collapsed` when a collapse criterion holds at the last sample and at every sample
// since the one it names (collapse_step); a run that falls and recovers is healthy.
#include <vector>

#include "core/hooks.hpp"

namespace trainscope::probes {

double normalized_embedding_std(const at::Tensor& z);
double rankme(const at::Tensor& z);
double mean_entropy(const at::Tensor& probs);              // nats, averaged over the batch
double mean_kl(const at::Tensor& p, const at::Tensor& q);  // KL(p || q), averaged over the batch

// The collapse criteria; their thresholds are in the section, so a reader can check them.
inline constexpr double kCollapseStdFraction = 0.1;  // std below 10% of 1/sqrt(d)
inline constexpr double kCollapseRank = 2.0;         // fewer than 2 effective dimensions
inline constexpr double kCollapseLossFraction = 0.01;  // loss within 1% of its collapsed value
inline constexpr double kCollapseKl = 1e-3;          // DINO: teacher and student agree to 1e-3 nats

class SslHealthProbe : public Probe {
 public:
  explicit SslHealthProbe(int64_t every) : every_(every) {}
  std::string name() const override { return "ssl_health"; }
  bool wants_embeddings(int64_t step) const override { return every_ > 0 && step % every_ == 0; }
  void embeddings(const EmbeddingSample& e) override;
  json section() const override;

 private:
  struct Sample {
    int64_t step;
    double loss, std, rank;
    double teacher_entropy = -1, kl = -1;  // < 0: not a DINO sample
    double collapse_loss = -1;
  };
  bool collapsed(const Sample& s, std::string* why) const;
  int64_t every_;
  int64_t dim_ = 0;
  std::vector<Sample> samples_;
};

}  // namespace trainscope::probes
