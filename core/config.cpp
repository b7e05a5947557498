#include "core/config.hpp"

#include <cmath>
#include <sstream>

#include "core/errors.hpp"

namespace trainscope {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

std::vector<std::string> key_names() {
  std::vector<std::string> names;
  for (const auto& k : config_keys()) names.push_back(k.name);
  return names;
}

std::string describe(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

}  // namespace

const std::vector<KeySpec>& config_keys() {
  static const std::vector<KeySpec> keys = {
      {"model", KeyKind::Choice,
       {"mlp-tiny", "mlp", "mlp-large", "cnn-tiny", "cnn", "resnet18", "gpt-tiny", "gpt-small",
        "gpt-125m", "gpt-1b"},
       "mlp", "reference model preset (trainscope list shows sizes)"},
      {"data", KeyKind::Choice, {"auto", "fashion-mnist", "synthetic-images", "synthetic-tokens"},
       "auto", "data source; auto: Fashion-MNIST for MLP/CNN, synthetic tokens for GPT"},
      {"precision", KeyKind::Choice, {"32-true", "tf32", "bf16-mixed"}, "32-true",
       "numeric precision (Lightning's names)"},
      {"parallel", KeyKind::Choice, {"single"}, "single", "parallel strategy"},
      {"world_size", KeyKind::Int, {}, 1, "number of ranks", 1},
      {"checkpoint", KeyKind::Choice, {"none"}, "none", "activation checkpointing policy"},
      {"method", KeyKind::Choice, {"supervised"}, "supervised", "training objective"},
      {"optimizer", KeyKind::Choice, {"adamw", "sgd"}, "adamw", "optimizer (sgd uses momentum 0.9)"},
      {"lr", KeyKind::Float, {}, 1e-3, "learning rate", 0},
      {"weight_decay", KeyKind::Float, {}, 0.0, "decoupled weight decay", 0},
      {"batch_size", KeyKind::Int, {}, 64, "samples per optimizer step", 1},
      {"steps", KeyKind::Int, {}, 100, "measured optimizer steps (after warm-up)", 1},
      {"warmup_steps", KeyKind::Int, {}, 5, "steps run before measuring", 0},
      {"seed", KeyKind::Int, {}, 0, "seed of every generator", 0},
      {"device", KeyKind::String, {}, "auto", "auto, cpu, cuda or cuda:<index>"},
      {"threads", KeyKind::Int, {}, 0, "intra-op CPU threads; 0: one per core", 0},
      {"timeout_s", KeyKind::Float, {}, 600.0, "wall-clock limit of the cell's process", 0},
      {"log_every", KeyKind::Int, {}, 0, "loss-curve sampling interval; 0: about 50 points", 0},
      {"eval", KeyKind::Bool, {}, true, "evaluate test accuracy after training (classifiers)"},
      {"inject", KeyKind::Choice, {"none", "crash", "abort", "hang", "throw"}, "none",
       "inject a fault into the cell's process (to test isolation)"},
  };
  return keys;
}

const KeySpec& key_spec(const std::string& name) {
  for (const auto& k : config_keys())
    if (k.name == name) return k;
  throw UsageError("unknown key '" + name + "' (allowed: " + join(key_names()) + ")");
}

json validate_value(const std::string& key, const json& value) {
  const KeySpec& spec = key_spec(key);
  auto bad = [&](const std::string& want) {
    return UsageError("bad value " + describe(value) + " for '" + key + "': " + want);
  };
  switch (spec.kind) {
    case KeyKind::Choice: {
      if (value.is_string())
        for (const auto& c : spec.choices)
          if (c == value.get<std::string>()) return value;
      throw UsageError("unknown " + key + " '" + describe(value) + "' (allowed: " +
                       join(spec.choices) + ")");
    }
    case KeyKind::String: {
      if (!value.is_string()) throw bad("expected a string");
      if (key == "device") {
        const std::string d = value.get<std::string>();
        const bool ok = d == "auto" || d == "cpu" || d == "cuda" ||
                        (d.rfind("cuda:", 0) == 0 && d.size() > 5 &&
                         d.find_first_not_of("0123456789", 5) == std::string::npos);
        if (!ok) throw UsageError("unknown device '" + d + "' (allowed: auto, cpu, cuda, cuda:<index>)");
      }
      return value;
    }
    case KeyKind::Int: {
      if (!value.is_number_integer() &&
          !(value.is_number_float() && std::floor(value.get<double>()) == value.get<double>()))
        throw bad("expected an integer");
      const int64_t v = value.is_number_integer() ? value.get<int64_t>()
                                                  : static_cast<int64_t>(value.get<double>());
      if (v < spec.min) throw bad("must be at least " + std::to_string(static_cast<int64_t>(spec.min)));
      return v;
    }
    case KeyKind::Float: {
      if (!value.is_number()) throw bad("expected a number");
      const double v = value.get<double>();
      if (!std::isfinite(v) || v < spec.min) throw bad("must be a finite number >= " + describe(spec.min));
      return v;
    }
    case KeyKind::Bool:
      if (!value.is_boolean()) throw bad("expected true or false");
      return value;
  }
  throw bad("unsupported kind");
}

json parse_value(const std::string& key, const std::string& text) {
  const KeySpec& spec = key_spec(key);
  switch (spec.kind) {
    case KeyKind::Choice:
    case KeyKind::String:
      return validate_value(key, text);
    case KeyKind::Bool:
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
      throw UsageError("bad value '" + text + "' for '" + key + "': expected true or false");
    case KeyKind::Int:
    case KeyKind::Float: {
      // The whole text must be a number: "32", "1e-3"; "32x" is an error.
      size_t used = 0;
      double v = 0;
      try {
        v = std::stod(text, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != text.size() || text.empty())
        throw UsageError("bad value '" + text + "' for '" + key + "': expected a number");
      return validate_value(key, json(v));  // Int accepts a float with no fraction
    }
  }
  throw UsageError("bad value for '" + key + "'");
}

json RunConfig::to_json() const {
  return json{{"model", model},         {"data", data},
              {"precision", precision}, {"parallel", parallel},
              {"world_size", world_size}, {"checkpoint", checkpoint},
              {"method", method},       {"optimizer", optimizer},
              {"lr", lr},               {"weight_decay", weight_decay},
              {"batch_size", batch_size}, {"steps", steps},
              {"warmup_steps", warmup_steps}, {"seed", seed},
              {"device", device},       {"threads", threads},
              {"timeout_s", timeout_s}, {"log_every", log_every},
              {"eval", eval},           {"inject", inject}};
}

RunConfig RunConfig::from_json(const json& j) {
  if (!j.is_object()) throw UsageError("a run configuration must be a table of key = value");
  json merged = RunConfig{}.to_json();
  for (auto it = j.begin(); it != j.end(); ++it) merged[it.key()] = validate_value(it.key(), it.value());
  RunConfig c;
  c.model = merged["model"];
  c.data = merged["data"];
  c.precision = merged["precision"];
  c.parallel = merged["parallel"];
  c.world_size = merged["world_size"];
  c.checkpoint = merged["checkpoint"];
  c.method = merged["method"];
  c.optimizer = merged["optimizer"];
  c.lr = merged["lr"];
  c.weight_decay = merged["weight_decay"];
  c.batch_size = merged["batch_size"];
  c.steps = merged["steps"];
  c.warmup_steps = merged["warmup_steps"];
  c.seed = merged["seed"];
  c.device = merged["device"];
  c.threads = merged["threads"];
  c.timeout_s = merged["timeout_s"];
  c.log_every = merged["log_every"];
  c.eval = merged["eval"];
  c.inject = merged["inject"];
  return c;
}

json config_for_report(const RunConfig& c) { return c.to_json(); }

std::string axis_label(const std::string& key, const json& value) {
  const std::string v = describe(value);
  if (key == "model" || key == "precision" || key == "parallel" || key == "method" || key == "data" ||
      key == "optimizer" || key == "device")
    return v;
  if (key == "batch_size") return "bs" + v;
  if (key == "checkpoint") return "ckpt-" + v;
  if (key == "world_size") return "ws" + v;
  if (key == "steps") return "steps" + v;
  if (key == "seed") return "seed" + v;
  std::ostringstream out;
  out << key << "=" << v;
  return out.str();
}

}  // namespace trainscope
