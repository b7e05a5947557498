#include "probes/ssl/health.hpp"

#include <cmath>
#include <sstream>

#include <ATen/ATen.h>

namespace trainscope::probes {

double normalized_embedding_std(const at::Tensor& z) {
  const at::Tensor zf = z.detach().to(at::kFloat);
  const at::Tensor n = zf / zf.norm(2, 1, /*keepdim=*/true).clamp_min(1e-12);
  return n.std(0, /*unbiased=*/true).mean().item<double>();
}

double rankme(const at::Tensor& z) {
  const at::Tensor s = at::linalg_svdvals(z.detach().to(at::kFloat).cpu());
  const at::Tensor p = s / s.sum().clamp_min(1e-12) + 1e-7;  // RankMe's epsilon (Garrido et al.)
  return std::exp(-(p * p.log()).sum().item<double>());
}

double mean_entropy(const at::Tensor& probs) {
  const at::Tensor p = probs.detach().to(at::kFloat);
  return (-(p * p.clamp_min(1e-12).log()).sum(-1)).mean().item<double>();
}

double mean_kl(const at::Tensor& p, const at::Tensor& q) {
  const at::Tensor pf = p.detach().to(at::kFloat), qf = q.detach().to(at::kFloat);
  return (pf * (pf.clamp_min(1e-12).log() - qf.clamp_min(1e-12).log())).sum(-1).mean().item<double>();
}

void SslHealthProbe::embeddings(const EmbeddingSample& e) {
  if (!e.embeddings.defined()) return;
  Sample s{e.step, e.loss, normalized_embedding_std(e.embeddings), rankme(e.embeddings)};
  s.collapse_loss = e.collapse_loss;
  if (e.teacher_probs.defined() && e.student_probs.defined()) {
    s.teacher_entropy = mean_entropy(e.teacher_probs);
    s.kl = mean_kl(e.teacher_probs, e.student_probs);
  }
  dim_ = e.embeddings.size(1);
  samples_.push_back(s);
}

bool SslHealthProbe::collapsed(const Sample& s, std::string* why) const {
  std::ostringstream out;
  const double ref = 1.0 / std::sqrt(static_cast<double>(dim_));
  if (s.std < kCollapseStdFraction * ref)
    out << "embedding std " << s.std << " < " << kCollapseStdFraction << " x 1/sqrt(" << dim_ << ")";
  else if (s.rank < kCollapseRank)
    out << "effective rank (RankMe) " << s.rank << " < " << kCollapseRank;
  else if (s.collapse_loss > 0 && std::abs(s.loss - s.collapse_loss) <= kCollapseLossFraction * s.collapse_loss)
    out << "loss " << s.loss << " within 1% of its collapsed value " << s.collapse_loss;
  else if (s.kl >= 0 && s.kl < kCollapseKl)
    out << "KL(teacher || student) " << s.kl << " < " << kCollapseKl;
  if (why) *why = out.str();
  return !out.str().empty();
}

json SslHealthProbe::section() const {
  json samples = json::array();
  for (const auto& s : samples_) {
    json j = {{"step", s.step}, {"loss", s.loss}, {"embedding_std", s.std}, {"rankme", s.rank}};
    j["teacher_entropy"] = s.teacher_entropy >= 0 ? json(s.teacher_entropy) : json(nullptr);
    j["kl"] = s.kl >= 0 ? json(s.kl) : json(nullptr);
    samples.push_back(j);
  }
  json out = {{"every", every_}, {"dim", dim_}, {"std_reference", dim_ ? 1.0 / std::sqrt(static_cast<double>(dim_)) : 0.0},
              {"collapse_loss", !samples_.empty() && samples_.back().collapse_loss > 0 ? json(samples_.back().collapse_loss) : json(nullptr)},
              {"thresholds", {{"std_fraction", kCollapseStdFraction}, {"rankme", kCollapseRank},
                              {"loss_fraction", kCollapseLossFraction}, {"kl", kCollapseKl}}},
              {"samples", samples}};
  // Collapsed: the criteria hold at the last sample, and have since collapse_step.
  std::string why;
  if (!samples_.empty() && collapsed(samples_.back(), &why)) {
    size_t first = samples_.size() - 1;
    while (first > 0 && collapsed(samples_[first - 1], nullptr)) --first;
    out["verdict"] = "collapsed";
    out["collapse_step"] = samples_[first].step;
    out["reason"] = why + " (since step " + std::to_string(samples_[first].step) + ")";
  } else {
    out["verdict"] = samples_.empty() ? "unsampled" : "healthy";
    out["collapse_step"] = nullptr;
    out["reason"] = samples_.empty() ? "no step was sampled" : "no collapse criterion holds at the last sample";
  }
  return out;
}

}  // namespace trainscope::probes
