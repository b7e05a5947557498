#include "suites/ssl/evaluate.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>

#include "core/errors.hpp"

namespace trainscope::suites::ssl {

namespace F = torch::nn::functional;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }
torch::Tensor unit(const torch::Tensor& x) { return F::normalize(x.to(torch::kFloat), F::NormalizeFuncOptions().dim(1)); }

}  // namespace

double knn_accuracy(const torch::Tensor& bank, const torch::Tensor& bank_labels, const torch::Tensor& queries,
                    const torch::Tensor& query_labels, int64_t k, double temperature, int64_t classes) {
  torch::NoGradGuard no_grad;
  const torch::Tensor b = unit(bank), labels = bank_labels.to(b.device());
  const int64_t n = queries.size(0), kk = std::min<int64_t>(k, b.size(0));
  int64_t correct = 0;
  for (int64_t i = 0; i < n; i += 1000) {
    const int64_t m = std::min<int64_t>(1000, n - i);
    const torch::Tensor q = unit(queries.narrow(0, i, m).to(b.device()));
    const auto [sim, idx] = q.mm(b.t()).topk(kk, 1);
    const torch::Tensor votes = torch::zeros({m, classes}, sim.options()).scatter_add_(1, labels.index({idx}), torch::exp(sim / temperature));
    correct += votes.argmax(1).eq(query_labels.narrow(0, i, m).to(b.device())).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(n);
}

namespace {

// A trained probe, folded back onto the raw features: logits = weight x f + bias.
struct ProbeFit {
  double accuracy = 0;
  torch::Tensor weight, bias;
};

ProbeFit fit_probe(const torch::Tensor& train_features, const torch::Tensor& train_labels, const torch::Tensor& test_features,
                   const torch::Tensor& test_labels, int64_t epochs, int64_t seed, int64_t classes) {
  const torch::Tensor mean = train_features.mean(0), std = train_features.std(0) + 1e-6;
  const torch::Tensor x = (train_features - mean) / std, xt = (test_features - mean) / std;
  const torch::Tensor y = train_labels.to(x.device());
  const int64_t n = x.size(0), batch = std::min<int64_t>(256, n);
  const int64_t per_epoch = (n + batch - 1) / batch, total = std::max<int64_t>(epochs * per_epoch, 300);
  auto gen = generator(static_cast<uint64_t>(seed) * 7919 + 17);
  torch::Tensor w = (torch::randn({classes, x.size(1)}, gen) * 0.01).to(x.device()).requires_grad_(true);
  torch::Tensor bias = torch::zeros({classes}, x.options()).requires_grad_(true);
  torch::optim::SGD opt({w, bias}, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::Tensor order;
  for (int64_t s = 0; s < total; ++s) {
    const int64_t at = (s % per_epoch) * batch;
    if (at == 0) order = torch::randperm(n, gen, torch::kLong).to(x.device());
    const torch::Tensor idx = order.narrow(0, at, std::min(batch, n - at));
    for (auto& g : opt.param_groups()) g.options().set_lr(0.1 * 0.5 * (1 + std::cos(M_PI * s / total)));
    opt.zero_grad();
    F::cross_entropy(torch::linear(x.index({idx}), w, bias), y.index({idx})).backward();
    opt.step();
  }
  torch::NoGradGuard no_grad;
  ProbeFit fit;
  fit.accuracy = torch::linear(xt, w, bias).argmax(1).eq(test_labels.to(x.device())).to(torch::kDouble).mean().item<double>();
  // W ((f - m) / s) + b = (W / s) f + (b - (W / s) m)
  fit.weight = w.detach() / std;
  fit.bias = bias.detach() - fit.weight.mv(mean);
  return fit;
}

}  // namespace

double linear_probe(const torch::Tensor& train_features, const torch::Tensor& train_labels,
                    const torch::Tensor& test_features, const torch::Tensor& test_labels, int64_t epochs, int64_t seed,
                    int64_t classes) {
  return fit_probe(train_features, train_labels, test_features, test_labels, epochs, seed, classes).accuracy;
}

torch::Tensor label_subset(const torch::Tensor& labels, double fraction, int64_t seed, int64_t classes) {
  std::vector<torch::Tensor> parts;
  for (int64_t c = 0; c < classes; ++c) {
    const torch::Tensor members = (labels == c).nonzero().reshape({-1});
    const int64_t take = std::llround(fraction * static_cast<double>(members.size(0)));
    auto gen = generator(static_cast<uint64_t>(seed) * 1000003 + static_cast<uint64_t>(c) + 1);
    parts.push_back(members.index({torch::randperm(members.size(0), gen, torch::kLong).narrow(0, 0, take)}));
  }
  return std::get<0>(torch::cat(parts).sort());
}

torch::Tensor extract_features(ReferenceModel& encoder, const torch::Tensor& images, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  const bool was_training = encoder.is_training();
  encoder.eval();
  const auto dtype = encoder.parameters().front().scalar_type();
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < images.size(0); i += 1000) {
    const torch::Tensor x = images.narrow(0, i, std::min<int64_t>(1000, images.size(0) - i)).to(device, dtype);
    out.push_back(encoder.features(x).to(torch::kFloat));
  }
  encoder.train(was_training);
  return torch::cat(out);
}

namespace {

struct Split {
  torch::Tensor images, labels;
};

double test_accuracy(ReferenceModel& model, const Split& test, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model.eval();
  int64_t correct = 0;
  for (int64_t i = 0; i < test.images.size(0); i += 1000) {
    const int64_t m = std::min<int64_t>(1000, test.images.size(0) - i);
    correct += model.forward(test.images.narrow(0, i, m).to(device)).argmax(1).eq(test.labels.narrow(0, i, m).to(device)).sum().item<int64_t>();
  }
  model.train();
  return static_cast<double>(correct) / static_cast<double>(test.images.size(0));
}

struct CurvePoint {
  int64_t steps;
  double seconds, accuracy;
};

// Trains the preset's classifier on `train`, batch 64, random flips, recording the test accuracy at each
// of `checkpoints` (ascending step counts); seconds count training only. From scratch: a random
// initialisation, AdamW 1e-3. Fine-tuning: `source`'s encoder weights and statistics with the linear
// probe as the head (LP-FT, Kumar et al. 2022: a random head's first gradients would distort the
// features it is meant to use), AdamW 3e-4.
std::vector<CurvePoint> supervised_run(ReferenceModel* source, const ProbeFit* head, const EvalSetup& s, const Split& train,
                                       const Split& test, const std::vector<int64_t>& checkpoints, uint64_t seed) {
  torch::manual_seed(seed);
  const torch::Device device(s.device);
  auto model = make_model(s.preset, s.shape);
  if (source) {
    torch::NoGradGuard no_grad;
    auto from = source->named_parameters(), from_buffers = source->named_buffers();
    for (auto& item : model->named_parameters())
      if (const auto* p = from.find(item.key())) item.value().copy_(*p);
    for (auto& item : model->named_buffers())
      if (const auto* b = from_buffers.find(item.key())) item.value().copy_(*b);
    if (head) {
      auto params = model->named_parameters();
      params["head.weight"].copy_(head->weight);
      params["head.bias"].copy_(head->bias);
    }
  }
  model->to(device, torch::kFloat);
  model->train();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(source ? 3e-4 : 1e-3));
  auto gen = generator(seed * 31 + 7);
  const int64_t n = train.images.size(0), batch = std::min<int64_t>(64, n);
  std::vector<CurvePoint> curve;
  double seconds = 0;
  size_t next = 0;
  for (int64_t step = 1; step <= checkpoints.back(); ++step) {
    const auto t0 = Clock::now();
    const torch::Tensor idx = torch::randint(n, {batch}, gen, torch::kLong);
    torch::Tensor x = train.images.index({idx});
    const torch::Tensor flip = (torch::rand({batch}, gen) < 0.5).view({batch, 1, 1, 1});
    x = torch::where(flip, x.flip({3}), x).to(device);
    opt.zero_grad();
    F::cross_entropy(model->forward(x), train.labels.index({idx}).to(device)).backward();
    opt.step();
    seconds += since(t0);
    if (step == checkpoints[next]) {
      curve.push_back({step, seconds, test_accuracy(*model, test, device)});
      ++next;
    }
  }
  return curve;
}

json frozen_scores(const torch::Tensor& bank, const torch::Tensor& bank_y, const torch::Tensor& test, const torch::Tensor& test_y,
                   const EvalSetup& s) {
  const int64_t classes = s.shape.classes;
  return {{"knn", knn_accuracy(bank, bank_y, test, test_y, 20, 0.07, classes)},
          {"linear", linear_probe(bank, bank_y, test, test_y, s.config.probe_epochs, s.config.seed, classes)}};
}

// The raw-pixel floor depends only on the data and the protocol: computed once per run folder.
json raw_pixel_floor(const Split& bank, const Split& test, const EvalSetup& s) {
  std::ostringstream key;
  key << "bank=" << bank.images.size(0) << " probe_epochs=" << s.config.probe_epochs << " seed=" << s.config.seed
      << " data=" << s.config.data;
  if (!s.floors_cache.empty()) {
    std::ifstream in(s.floors_cache);
    if (in) {
      try {
        const json cached = json::parse(in);
        if (cached.value("key", "") == key.str()) return cached.at("floor");
      } catch (const std::exception&) {
        // A damaged cache is recomputed and rewritten.
      }
    }
  }
  const json floor = frozen_scores(bank.images.flatten(1), bank.labels, test.images.flatten(1), test.labels, s);
  if (!s.floors_cache.empty()) {
    const std::string tmp = s.floors_cache + ".tmp";
    std::ofstream(tmp) << json{{"key", key.str()}, {"floor", floor}}.dump();
    std::rename(tmp.c_str(), s.floors_cache.c_str());
  }
  return floor;
}

}  // namespace

json evaluate(ReferenceModel& encoder, DataSource& data, const EvalSetup& s) {
  const RunConfig& c = s.config;
  const std::string mode = ssl_eval_mode(c);
  if (mode == "off") return nullptr;
  const auto started = Clock::now();
  const torch::Device device(s.device);
  const Batch pool = data.train_set(), held_out = data.test_set();
  if (!pool.input.defined() || !held_out.input.defined())
    throw UsageError("ssl_eval needs labelled image data; " + data.describe() + " has none");
  const Split train{pool.input, pool.target}, test{held_out.input, held_out.target};
  const int64_t bank_n = c.eval_bank > 0 ? std::min(c.eval_bank, train.images.size(0)) : train.images.size(0);
  const Split bank{train.images.narrow(0, 0, bank_n), train.labels.narrow(0, 0, bank_n)};
  std::vector<double> fractions;
  parse_fractions(c.label_fractions, fractions);

  json out;
  out["protocol"] = {{"knn_k", 20}, {"knn_temperature", 0.07}, {"bank", bank_n}, {"queries", test.images.size(0)},
                     {"probe_epochs", c.probe_epochs}, {"finetune_steps", c.finetune_steps},
                     {"scratch_steps", c.scratch_steps}, {"label_seeds", json::array()}, {"fractions", fractions},
                     {"precision", "fp32"}};
  for (int64_t i = 0; i < c.label_seeds; ++i) out["protocol"]["label_seeds"].push_back(i);

  const torch::Tensor train_features = extract_features(encoder, train.images, device);
  const torch::Tensor test_features = extract_features(encoder, test.images, device);
  json frozen;
  frozen["encoder"] = frozen_scores(train_features.narrow(0, 0, bank_n), bank.labels, test_features, test.labels, s);
  {
    torch::manual_seed(static_cast<uint64_t>(c.seed) + 99991);
    auto random = make_model(s.preset, s.shape);
    random->to(device, torch::kFloat);
    frozen["random_encoder"] = frozen_scores(extract_features(*random, bank.images, device), bank.labels,
                                             extract_features(*random, test.images, device), test.labels, s);
  }
  frozen["raw_pixels"] = raw_pixel_floor(bank, test, s);
  out["frozen"] = frozen;

  json rows = json::array();
  if (mode == "full") {
    const bool ssl = c.method != "supervised";
    std::vector<int64_t> checkpoints;
    if (ssl) {
      checkpoints = {c.finetune_steps};
    } else {
      // Geometric points up to scratch_steps, so that any compute budget finds a run that fits it.
      for (int64_t k = std::max<int64_t>(1, c.finetune_steps / 2); k < c.scratch_steps; k *= 2) checkpoints.push_back(k);
      checkpoints.push_back(c.scratch_steps);
    }
    for (double f : fractions) {
      json row = {{"fraction", f}};
      json probe = json::array(), finetune = json::array(), finetune_s = json::array(), curves = json::array();
      int64_t labels = 0;
      for (int64_t seed = 0; seed < c.label_seeds; ++seed) {
        const torch::Tensor idx = label_subset(train.labels, f, seed, s.shape.classes);
        labels = idx.size(0);
        const Split subset{train.images.index({idx}), train.labels.index({idx})};
        if (ssl) {
          const ProbeFit fit = fit_probe(train_features.index({idx.to(train_features.device())}), subset.labels, test_features,
                                         test.labels, c.probe_epochs, seed, s.shape.classes);
          probe.push_back(fit.accuracy);
          const auto run = supervised_run(&encoder, &fit, s, subset, test, checkpoints, static_cast<uint64_t>(seed) + 1);
          finetune.push_back(run.back().accuracy);
          finetune_s.push_back(run.back().seconds);
        } else {
          json curve = json::array();
          for (const auto& p : supervised_run(nullptr, nullptr, s, subset, test, checkpoints, static_cast<uint64_t>(seed) + 1))
            curve.push_back({{"steps", p.steps}, {"seconds", p.seconds}, {"accuracy", p.accuracy}});
          curves.push_back(curve);
        }
      }
      row["labels"] = labels;
      if (ssl) {
        row["probe"] = probe;
        row["finetune"] = finetune;
        row["finetune_s"] = finetune_s;
      } else {
        row["scratch_curve"] = curves;
      }
      rows.push_back(row);
    }
  }
  out["label_efficiency"] = rows;
  out["eval_wall_s"] = since(started);
  return out;
}

}  // namespace trainscope::suites::ssl
