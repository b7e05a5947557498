#include "plan/search.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "core/build_info.hpp"
#include "core/errors.hpp"
#include "core/units.hpp"
#include "plan/step.hpp"

namespace trainscope::plan {

namespace {

// The dtype MFU is reported against: the GEMMs' own, except fp8, reported against the bf16 peak (as
// torchtitan and Megatron-Bridge do not count fp8 as a higher peak).
std::string mfu_dtype(const std::string& gemm) { return gemm == "fp8" ? "bf16" : gemm == "tf32" ? "tf32" : gemm; }

double gemm_flops(const std::vector<OpCost>& costs) {
  double f = 0;
  for (const auto& c : costs)
    if (c.m > 0) f += 2.0 * static_cast<double>(c.m) * static_cast<double>(c.n) * static_cast<double>(c.k) * static_cast<double>(c.batch);
  return f;
}

// Precisions ranked but not recommended unless asked for (--set precision=...): the reason.
std::string precision_note(const std::string& p) {
  if (p == "bf16-true") return "bf16 weights and optimizer state, no fp32 master copy: updates below bf16's resolution are lost";
  if (p == "fp8") return "e4m3 GEMMs in the linear layers: check the loss against bf16-mixed before relying on it";
  if (p == "16-mixed") return "fp16 needs the dynamic loss scaler; bf16-mixed needs none at the same speed";
  return "";
}

}  // namespace

json make_plan(const PlanRequest& r) {
  const auto started = std::chrono::steady_clock::now();
  const ModelShape& m = r.model;
  if (!m.language_model()) throw UsageError("plan: the search plans decoders (gpt, llama); " + m.name + " is a " + m.family);
  const int64_t ranks = r.cluster.ranks(), S = m.seq_len;
  const DeviceProfile& d = r.device;
  const double usable = static_cast<double>(d.memory_bytes) * (1.0 - r.headroom);
  // Global batch: whole sequences per rank per micro-batch step.
  int64_t global = r.global_tokens > 0 ? r.global_tokens : int64_t{1} << 20;
  const int64_t seqs_per_rank = std::max<int64_t>(1, global / (S * ranks));
  global = seqs_per_rank * S * ranks;

  auto axis = [&](const std::string& key, std::vector<std::string> all) {
    if (auto f = r.fixed.find(key); f != r.fixed.end()) return std::vector<std::string>{f->second};
    return all;
  };
  std::vector<std::string> precisions = {"32-true", "bf16-mixed", "16-mixed", "bf16-true"};
  if (d.has("fp8")) precisions.push_back("fp8");
  precisions = axis("precision", precisions);
  // hsdp (sharded within a node, replicated across nodes) only differs from zero3 across nodes.
  std::vector<std::string> all_strategies = {"ddp", "zero1", "zero2", "zero3"};
  if (r.cluster.nodes > 1) all_strategies.push_back("hsdp");
  const std::vector<std::string> strategies = ranks > 1 ? axis("parallel", all_strategies) : axis("parallel", {"single"});
  const std::vector<std::string> policies = axis("checkpoint", {"none", "selective", "every:8", "every:4", "every:2", "full"});
  const std::vector<std::string> attentions = axis("attention", {"sdpa", "eager"});
  std::vector<int64_t> micro;
  if (auto f = r.fixed.find("batch_size"); f != r.fixed.end()) {
    micro.push_back(std::stoll(f->second));
  } else {
    for (int64_t b = 1; b <= seqs_per_rank; b *= 2)
      if (seqs_per_rank % b == 0) micro.push_back(b);
  }
  for (int64_t b : micro)
    if (b < 1 || seqs_per_rank % b != 0)
      throw UsageError("plan: micro-batch " + std::to_string(b) + " does not divide the " + std::to_string(seqs_per_rank) +
                       " sequences per rank of the global batch (" + with_thousands(global) + " tokens)");
  for (const auto& s : strategies)
    if ((s == "single") != (ranks == 1)) throw UsageError("plan: parallel=" + s + " does not match " + std::to_string(ranks) + " rank(s)");

  const double fpt_full = decoder_flops_per_token(m, FlopConvention::Full);
  const double fpt_causal = decoder_flops_per_token(m, FlopConvention::Causal);
  json candidates = json::array();
  int64_t searched = 0;
  for (const auto& prec : precisions)
    for (const auto& strat : strategies)
      for (const auto& ckpt : policies)
        for (const auto& attn : attentions) {
          bool too_big = false;
          std::string too_big_reason;
          for (int64_t b : micro) {
            ++searched;
            json cand = {{"precision", prec}, {"parallel", strat}, {"checkpoint", ckpt}, {"attention", attn},
                         {"micro_batch", b}, {"accumulation", seqs_per_rank / b}};
            if (const std::string note = precision_note(prec); !note.empty()) cand["note"] = note;
            if (too_big) {
              // Memory grows with the micro-batch: a larger one than one that did not fit does not either.
              cand["fits"] = false;
              cand["reason"] = too_big_reason;
              candidates.push_back(cand);
              continue;
            }
            StepSetup s;
            s.replay.model = m;
            s.replay.model.attention = attn;
            s.replay.model.dropout = 0;
            s.replay.batch = b;
            s.replay.checkpoint = ckpt;
            s.replay.num = numerics_of(prec, d.gpu);
            s.replay.cuda = d.gpu;
            s.strategy = strat;
            s.world = ranks;
            s.shard = r.cluster.gpus_per_node;  // hsdp: one node's ranks
            s.resident_data_bytes = 0;
            const MemoryPrediction mp = predict_memory(s);
            const double peak = static_cast<double>(mp.peak);
            json mem = mp.to_json();
            mem.erase("phase_peak_bytes");
            mem.erase("baseline_bytes");
            mem.erase("data_bytes");
            const double states = static_cast<double>(mp.state.total());
            mem["peak_transient_bytes"] = std::max(0.0, peak - states - static_cast<double>(mp.activations));
            cand["memory"] = mem;
            cand["fits"] = peak <= usable;
            if (peak > usable) {
              std::string why = states > usable ? "model state " + format_gb(states) + " per rank > " + format_gb(usable) + " usable"
                                                : "peak " + format_gb(peak) + " per rank (model state " + format_gb(states) + ", activations " +
                                                      format_gb(static_cast<double>(mp.activations)) + ") > " + format_gb(usable) + " usable";
              // Autocast keeps a low-precision copy of every weight from its use to backward (saved by
              // the GEMM, or held by its cast cache under checkpointing): unsharded, whatever the strategy.
              if (s.replay.num.autocast && states <= usable)
                why += "; the activations include autocast's copies of every weight, " +
                       format_gb(2.0 * static_cast<double>(param_layout(s.replay).total())) + " unsharded";
              cand["reason"] = why;
              too_big = true;
              too_big_reason = "micro-batch " + std::to_string(b) + " already does not fit: " + why;
              candidates.push_back(cand);
              continue;
            }
            const TimePrediction tp = predict_time(s, mp, d, r.cluster, seqs_per_rank / b);
            cand["time"] = tp.to_json();
            const double tokens_per_gpu = static_cast<double>(seqs_per_rank * S) / tp.step_s;
            cand["tokens_per_s_per_gpu"] = tokens_per_gpu;
            const std::string pd = mfu_dtype(s.replay.num.gemm_dtype);
            if (d.peak_flops.count(pd)) {
              const double peak_flops = d.peak_flops.at(pd);
              cand["mfu"] = fpt_full * tokens_per_gpu / peak_flops;
              cand["mfu_causal"] = fpt_causal * tokens_per_gpu / peak_flops;
              // Hardware FLOPs add the recomputed forward's GEMMs.
              const double recompute_per_token = gemm_flops(mp.recompute_costs) / static_cast<double>(b * S);
              cand["hfu"] = (fpt_full + recompute_per_token) * tokens_per_gpu / peak_flops;
              cand["mfu_peak"] = {{"dtype", pd}, {"flops_per_s", peak_flops}};
            }
            candidates.push_back(cand);
          }
        }
  // Fits first, fastest first; then the rest in search order.
  std::stable_sort(candidates.begin(), candidates.end(), [](const json& a, const json& b) {
    if (a["fits"] != b["fits"]) return a["fits"].get<bool>();
    if (!a["fits"].get<bool>()) return false;
    const double ta = a["tokens_per_s_per_gpu"], tb = b["tokens_per_s_per_gpu"];
    if (ta != tb) return ta > tb;
    return a["memory"]["peak_bytes"].get<int64_t>() < b["memory"]["peak_bytes"].get<int64_t>();
  });
  int64_t fit = 0;
  for (const auto& c : candidates) fit += c["fits"].get<bool>() ? 1 : 0;

  // Why whole families do not fit: per (precision, strategy) the reason at its smallest configuration.
  json rejected = json::array();
  for (const auto& prec : precisions)
    for (const auto& strat : strategies) {
      bool any = false;
      std::string reason;
      for (const auto& c : candidates) {
        if (c["precision"] != prec || c["parallel"] != strat) continue;
        if (c["fits"].get<bool>()) any = true;
        else if (reason.empty() && c["micro_batch"] == micro.front() && c["checkpoint"] == policies.back()) reason = c["reason"];
      }
      if (!any) rejected.push_back({{"precision", prec}, {"parallel", strat}, {"reason", reason.empty() ? "no candidate fits" : reason}});
    }

  json rec;
  // The recommendation: the fastest that fits among the precisions that need no caveat (bf16-mixed,
  // 32-true), unless the precision was fixed; the others stay in the table with their notes.
  const json* pick = nullptr;
  for (const auto& c : candidates)
    if (c["fits"].get<bool>() && (r.fixed.count("precision") || !c.contains("note"))) {
      pick = &c;
      break;
    }
  if (!pick && fit > 0) pick = &candidates[0];  // only noted precisions fit: the fastest, with its note
  if (pick) {
    const json& best = *pick;
    char line[640];
    std::snprintf(line, sizeof line,
                  "%s on %lld x %s (%lld node%s): %s, %s, checkpoint %s, %s attention, micro-batch %lld x %lld accumulation: "
                  "about %s tokens/s per GPU, %s of %s per GPU",
                  m.name.c_str(), static_cast<long long>(ranks), d.name.c_str(), static_cast<long long>(r.cluster.nodes),
                  r.cluster.nodes > 1 ? "s" : "", best["precision"].get<std::string>().c_str(),
                  best["parallel"].get<std::string>().c_str(), best["checkpoint"].get<std::string>().c_str(),
                  best["attention"].get<std::string>().c_str(), static_cast<long long>(best["micro_batch"].get<int64_t>()),
                  static_cast<long long>(best["accumulation"].get<int64_t>()),
                  format_rate(best["tokens_per_s_per_gpu"].get<double>()).c_str(),
                  format_gb(best["memory"]["peak_bytes"].get<double>()).c_str(), format_gb(static_cast<double>(d.memory_bytes)).c_str());
    std::string text = line;
    if (best.contains("mfu")) {
      std::snprintf(line, sizeof line, ", MFU %.0f%% (full attention; %.0f%% causal)", 100 * best["mfu"].get<double>(),
                    100 * best["mfu_causal"].get<double>());
      text += line;
    }
    json why = json::array();
    why.push_back("fastest of the " + std::to_string(fit) + " configurations that fit in " + format_gb(usable) + " usable per GPU (" +
                  std::to_string(static_cast<int>(std::lround(100 * r.headroom))) + "% headroom)" +
                  (r.fixed.count("precision") ? "" : " among bf16-mixed and 32-true"));
    if (&best != &candidates[0]) {
      const json& top = candidates[0];
      why.push_back(top["precision"].get<std::string>() + " (" + top["parallel"].get<std::string>() + ", checkpoint " +
                    top["checkpoint"].get<std::string>() + ") would reach " +
                    std::to_string(static_cast<int>(std::lround(100 * top["tokens_per_s_per_gpu"].get<double>() /
                                                                best["tokens_per_s_per_gpu"].get<double>()))) +
                    "% of this throughput: " + top.value("note", std::string()));
    }
    why.push_back("step " + format_seconds(best["time"]["step_s"]) + ": compute " + format_seconds(best["time"]["compute_s"]) +
                  ", exposed communication " + format_seconds(best["time"]["exposed_comm_s"]) + " (" +
                  best["time"]["bound"].get<std::string>() + "-bound)");
    // Each other strategy: its best eligible configuration for contrast, or why it does not fit in
    // the recommended precision.
    const bool any_precision = r.fixed.count("precision") > 0;
    for (const auto& strat : strategies) {
      if (strat == best["parallel"]) continue;
      bool found = false;
      for (const auto& c : candidates)
        if (c["fits"].get<bool>() && c["parallel"] == strat && (any_precision || !c.contains("note"))) {
          const double ratio = c["tokens_per_s_per_gpu"].get<double>() / best["tokens_per_s_per_gpu"].get<double>();
          why.push_back("best " + strat + " (" + c["precision"].get<std::string>() + ", checkpoint " + c["checkpoint"].get<std::string>() +
                        ", micro-batch " + std::to_string(c["micro_batch"].get<int64_t>()) + "): " +
                        std::to_string(static_cast<int>(std::lround(100 * ratio))) + "% of its throughput");
          found = true;
          break;
        }
      if (found) continue;
      for (const auto& rj : rejected)
        if (rj["parallel"] == strat && rj["precision"] == best["precision"])
          why.push_back(strat + " does not fit in " + best["precision"].get<std::string>() + ": " + rj["reason"].get<std::string>());
    }
    rec = {{"text", text}, {"candidate", best}, {"reasoning", why}};
  } else {
    std::string text = "nothing fits " + m.name + " on " + std::to_string(ranks) + " x " + d.name + ": ";
    text += rejected.empty() ? "" : rejected[rejected.size() - 1]["reason"].get<std::string>();
    text += "; more GPUs (zero3 divides the model state by the rank count) or a device with more memory";
    rec = {{"text", text}, {"candidate", nullptr}, {"reasoning", json::array()}};
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  json fixed = json::object();
  for (const auto& [k, v] : r.fixed) fixed[k] = v;
  return {{"schema", "trainscope.plan/1"},
          {"trainscope", {{"version", version()}, {"commit", commit()}}},
          {"created", utc_now()},
          {"request", {{"model", m.to_json()}, {"model_name", m.name}, {"parameters", analytic_decoder_parameters(m)},
                       {"cluster", {{"gpus_per_node", r.cluster.gpus_per_node}, {"nodes", r.cluster.nodes}, {"ranks", ranks}}},
                       {"device", d.name}, {"seq_len", S}, {"global_batch_tokens", global},
                       {"sequences_per_rank", seqs_per_rank}, {"headroom", r.headroom}, {"usable_bytes", usable}, {"fixed", fixed}}},
          {"device", d.to_json()},
          {"flops", {{"convention", flop_convention_name(FlopConvention::Full)}, {"per_token", fpt_full},
                     {"causal_per_token", fpt_causal}}},
          {"searched", searched},
          {"fit", fit},
          {"search_seconds", seconds},
          {"candidates", candidates},
          {"rejected", rejected},
          {"recommendation", rec},
          {"memory_model", "replayed per operator: every tensor the implementation allocates, saves for backward and frees "
                           "(plan/models.cpp), the strategy's buffers and the optimizer's state and temporaries (plan/step.cpp)"},
          {"assumptions", {"CUDA context, cuBLAS/NCCL workspaces and the caching allocator's fragmentation are inside the headroom",
                           "eager attention on a GPU is replayed as on the CPU (bf16 softmax); CUDA autocast keeps it fp32",
                           "gradient accumulation synchronises gradients once per optimizer step (zero3 gathers per micro-batch)"}}};
}

json predict_config(const RunConfig& c, const DeviceProfile& device, bool cuda) {
  const StepSetup s = step_setup(c, cuda);
  const MemoryPrediction mp = predict_memory(s);
  json out = {{"memory", mp.to_json()}};
  const double share = device.gpu || device.cores <= 0 ? 1.0 : std::min(1.0, static_cast<double>(device.cores) / static_cast<double>(c.world_size));
  out["time"] = predict_time(s, mp, device, Cluster{c.world_size, 1}, 1, share).to_json();
  return out;
}

}  // namespace trainscope::plan
