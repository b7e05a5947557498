#include "core/layout.hpp"

#include <regex>
#include <sstream>

#include "core/errors.hpp"

namespace trainscope {
namespace {

std::string n(int64_t v) { return std::to_string(v); }

int64_t& field(ParallelLayout& l, const std::string& dim) {
  if (dim == "pp") return l.pp;
  if (dim == "dp_replicate") return l.dp_replicate;
  if (dim == "dp_shard") return l.dp_shard;
  if (dim == "cp") return l.cp;
  return l.tp;
}

}  // namespace

const std::vector<std::string>& ParallelLayout::dimensions() {
  static const std::vector<std::string> d = {"pp", "dp_replicate", "dp_shard", "cp", "tp"};
  return d;
}

int64_t ParallelLayout::degree(const std::string& dim) const { return field(const_cast<ParallelLayout&>(*this), dim); }

std::string ParallelLayout::name() const {
  if (shard_by_host) return "hsdp";
  std::string out;
  for (const auto& d : dimensions())
    if (degree(d) > 1) out += (out.empty() ? "" : "-") + d + n(degree(d));
  if (out.empty()) return "single";
  if (dp_shard > 1 && sharding != "zero3") out += "-" + sharding;
  if (dp_shard == 1 && dp_replicate == 1 && cp > 1 && sharding != "none") out += "-" + sharding;  // sharded over cp's ranks
  return out;
}

std::string ParallelLayout::strategy() const {
  if (shard_by_host) return "hsdp";
  if (dp_shard > 1) return dp_replicate > 1 ? "hsdp" : sharding;
  return dp_replicate > 1 ? "ddp" : "single";
}

json ParallelLayout::to_json() const {
  return {{"dp_replicate", dp_replicate}, {"dp_shard", dp_shard}, {"tp", tp}, {"pp", pp}, {"cp", cp}, {"name", name()}};
}

bool ParallelLayout::operator==(const ParallelLayout& o) const {
  return pp == o.pp && dp_replicate == o.dp_replicate && dp_shard == o.dp_shard && cp == o.cp && tp == o.tp &&
         sharding == o.sharding && shard_by_host == o.shard_by_host;
}

ParallelLayout parse_layout(const std::string& text) {
  const std::string grammar =
      "layout '" + text + "': expected dimensions joined by '-', each a name and a degree (pp, dp_replicate, dp_shard, cp, "
      "tp: dp_shard4-tp2), optionally -zero1 or -zero2 (how dp_shard shards; with cp alone -zero3 too: over cp's ranks), or single";
  ParallelLayout l;
  if (text == "single") return l;
  static const std::regex dim("(pp|dp_replicate|dp_shard|cp|tp)([1-9][0-9]{0,5})");
  std::vector<bool> seen(ParallelLayout::dimensions().size(), false);
  std::string level = "zero3";
  bool level_given = false;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = text.find('-', start);
    const std::string part = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    std::smatch m;
    if (part == "zero1" || part == "zero2" || part == "zero3") {
      level = part;
      level_given = true;
    } else if (std::regex_match(part, m, dim)) {
      const auto& dims = ParallelLayout::dimensions();
      const size_t i = std::find(dims.begin(), dims.end(), m[1].str()) - dims.begin();
      if (seen[i]) throw UsageError("layout '" + text + "': " + m[1].str() + " is given twice");
      seen[i] = true;
      field(l, m[1].str()) = std::stoll(m[2].str());
    } else {
      throw UsageError(grammar);
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (l.dp_shard > 1 || (level_given && l.cp > 1 && l.dp_replicate == 1)) l.sharding = level;  // over dp_shard (and cp's ranks)
  else if (level != "zero3") throw UsageError("layout '" + text + "': " + level + " shards over dp_shard, which it does not set");
  return l;
}

ParallelLayout given_layout(const RunConfig& c) {
  ParallelLayout l;
  l.pp = c.pp, l.dp_replicate = c.dp_replicate, l.dp_shard = c.dp_shard, l.cp = c.cp, l.tp = c.tp;
  if (!c.layout.empty()) {
    const ParallelLayout named = parse_layout(c.layout);
    for (const auto& d : ParallelLayout::dimensions())
      if (l.degree(d) != 1 && l.degree(d) != named.degree(d))
        throw UsageError("layout '" + c.layout + "' has " + d + " " + n(named.degree(d)) + ", but " + d + " = " + n(l.degree(d)));
    l = named;
  }
  if (l.dp_shard > 1 && l.sharding == "none") l.sharding = "zero3";
  return l;
}

ParallelLayout resolve_layout(const RunConfig& c) {
  ParallelLayout l = given_layout(c);
  if (c.parallel == "single" && l.world() == 1) return l;
  if (c.parallel != "single") {
    // The shorthand: the data-parallel strategy over the ranks the other dimensions leave.
    const int64_t model = l.tp * l.pp * l.cp;
    if (c.world_size % model != 0)
      throw UsageError("world_size " + n(c.world_size) + " is not a multiple of tp x pp x cp = " + n(model));
    const int64_t rest = c.world_size / model;
    ParallelLayout d = l;
    d.dp_replicate = 1, d.dp_shard = 1, d.sharding = "none";
    if (c.parallel == "ddp") {
      d.dp_replicate = rest;
    } else if (c.parallel == "hsdp") {
      d.sharding = "zero3";
      if (c.hsdp_shard_size > 0) {
        if (rest % c.hsdp_shard_size != 0)
          throw UsageError("hsdp_shard_size " + n(c.hsdp_shard_size) + " does not divide the " + n(rest) + " data-parallel ranks");
        d.dp_shard = c.hsdp_shard_size, d.dp_replicate = rest / c.hsdp_shard_size;
      } else {
        d.dp_shard = rest, d.shard_by_host = true;  // split into nodes at launch
      }
    } else {
      d.dp_shard = rest, d.sharding = c.parallel;
    }
    const bool given = l.dp_replicate != 1 || l.dp_shard != 1;
    if (given && !d.shard_by_host && (l.dp_replicate != d.dp_replicate || l.dp_shard != d.dp_shard))
      throw UsageError("parallel = " + c.parallel + " over " + n(rest) + " ranks means " + d.name() + ", but the layout says " + l.name());
    l = d;
  }
  if (!l.shard_by_host && l.world() != c.world_size)
    throw UsageError("layout " + l.name() + " needs " + n(l.world()) + " ranks (the product of its degrees), but world_size is " +
                     n(c.world_size));
  return l;
}

void check_layout_fits(const ParallelLayout& l, const ModelShape& m) {
  auto fail = [&](const std::string& what) { throw UsageError("layout " + l.name() + ": " + what + " (model " + m.name + ")"); };
  if (l.tp > 1) {
    if (!m.language_model()) fail("tp splits a decoder's attention heads and MLP; " + m.family + " models have none");
    if (m.heads % l.tp != 0) fail("tp " + n(l.tp) + " does not divide the " + n(m.heads) + " attention heads");
    if (m.kv_heads % l.tp != 0 && l.tp % m.kv_heads != 0)
      fail("tp " + n(l.tp) + " and the " + n(m.kv_heads) + " key/value heads: neither divides the other");
    const int64_t ffn = m.family == "llama" ? m.ffn : 4 * m.width;
    if (ffn % l.tp != 0) fail("tp " + n(l.tp) + " does not divide the MLP's " + n(ffn) + " hidden units");
    if (m.vocab % l.tp != 0) fail("tp " + n(l.tp) + " does not divide the vocabulary of " + n(m.vocab));
    if (m.seq_len % l.tp != 0) fail("tp " + n(l.tp) + " does not divide the sequence of " + n(m.seq_len) + " (sequence parallelism splits it)");
  }
  if (l.cp > 1) {
    if (!m.language_model()) fail("cp splits a decoder's sequence; " + m.family + " models have none");
    if (m.seq_len % (2 * l.cp) != 0) fail("cp " + n(l.cp) + " needs the sequence (" + n(m.seq_len) + ") in 2 x cp equal chunks");
  }
  if (l.pp > 1) {
    if (!m.language_model()) fail("pp splits a decoder's layers; " + m.family + " models are not pipelined here");
    if (m.layers < l.pp) fail("pp " + n(l.pp) + " stages for " + n(m.layers) + " layers");
  }
}

ParallelLayout fold_context(const ParallelLayout& l) {
  ParallelLayout f = l;
  if (l.cp == 1) return f;
  // cp alone at a sharding level (parallel = zero3 over the cp ranks: "cp8-zero3") shards over them too.
  const bool shard = l.dp_shard > 1 || (l.dp_replicate == 1 && l.sharding != "none");
  (shard ? f.dp_shard : f.dp_replicate) *= l.cp;
  f.cp = 1;
  return f;
}

std::vector<double> context_parallel_pairs(int64_t S, int64_t cp, bool balance) {
  const auto chunk = [](double h, double first) { return h * first + h * (h + 1) / 2; };
  std::vector<double> out;
  for (int64_t r = 0; r < cp; ++r) {
    if (!balance) {
      const double c = static_cast<double>(S / cp);
      out.push_back(chunk(c, static_cast<double>(r) * c));
    } else {
      const double h = static_cast<double>(S / (2 * cp));
      out.push_back(chunk(h, static_cast<double>(r) * h) + chunk(h, static_cast<double>(2 * cp - 1 - r) * h));
    }
  }
  return out;
}

bool pipelines_with(const ParallelLayout& l) {
  return l.cp == 1 && l.dp_replicate == 1 && (l.dp_shard == 1 || l.sharding == "zero3");
}

std::string layout_unsupported(const ParallelLayout& l) {
  if (l.cp > 1 && l.pp > 1) return "cp with pp (layout " + l.name() + ") is not implemented in this build yet";
  if (l.pp > 1 && !pipelines_with(l))
    return "pp with other dimensions than tp and dp_shard at zero3 (layout " + l.name() + ") is not implemented in this build yet";
  if (l.dp_replicate > 1 && l.dp_shard > 1 && l.sharding != "zero3")
    return "dp_replicate x dp_shard shards at zero3 (hsdp); " + l.sharding + " with replicas is not implemented";
  return "";
}

pipeline::Schedule resolve_pipeline(const RunConfig& c, const ParallelLayout& l, const ModelShape& m) {
  const auto n = [](int64_t x) { return std::to_string(x); };
  const int64_t v = c.pp_virtual > 0 ? c.pp_virtual : l.pp > 1 ? pipeline::default_stages_per_rank(c.pp_schedule) : 1;
  const int64_t mb = c.pp_microbatches > 0 ? c.pp_microbatches : l.pp > 1 ? pipeline::default_microbatches(c.pp_schedule, l.pp) : 1;
  if (l.pp == 1 && (v > 1 || c.pp_schedule != "1f1b")) throw UsageError("pp_schedule and pp_virtual need pp > 1");
  pipeline::Schedule s = pipeline::make_schedule(c.pp_schedule, l.pp, mb, v);
  if (c.batch_size % mb != 0)
    throw UsageError("pp_microbatches " + n(mb) + " does not divide batch_size " + n(c.batch_size) + " (the batch of each data-parallel rank)");
  if (l.pp > 1 && m.layers < s.stages())
    throw UsageError(n(s.stages()) + " pipeline stages (pp " + n(l.pp) + " x pp_virtual " + n(v) + ") are more than the " + n(m.layers) +
                     " layers");
  if (!c.pp_split.empty() && l.pp == 1) throw UsageError("pp_split cuts the layers into pipeline stages: it needs pp > 1");
  std::vector<int64_t> split;
  std::stringstream in(c.pp_split);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty() || item.size() > 9 || item.find_first_not_of("0123456789") != std::string::npos)
      throw UsageError("pp_split '" + c.pp_split + "': expected layer counts joined by commas (7,8,8,7)");
    split.push_back(std::stoll(item));
  }
  if (l.pp > 1) s.cuts = pipeline::stage_layers(m.layers, s.stages(), split);
  return s;
}

}  // namespace trainscope
