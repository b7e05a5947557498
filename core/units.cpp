#include "core/units.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <ctime>

namespace trainscope {

std::string format_fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

std::string format_signed_pct(double pct, int decimals) {
  return (pct >= 0 ? "+" : "-") + format_fixed(std::fabs(pct), decimals) + "%";
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return format_fixed(bytes, u == 0 ? 0 : 1) + " " + units[u];
}

std::string format_seconds(double s) {
  if (s < 1e-3) return format_fixed(s * 1e6, 0) + " us";
  if (s < 1) return format_fixed(s * 1e3, s < 0.1 ? 2 : 1) + " ms";
  if (s < 120) return format_fixed(s, 2) + " s";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  return buf;
}

std::string format_rate(double v) {
  const char* units[] = {"", "k", "M", "G", "T", "P"};
  int u = 0;
  while (std::fabs(v) >= 1000 && u < 5) {
    v /= 1000;
    ++u;
  }
  return format_fixed(v, v >= 100 ? 0 : 1) + units[u];
}

bool parse_bytes(const std::string& text, double& bytes) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    return false;
  }
  std::string unit = text.substr(used);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KIB") scale = 1024.0;
  else if (unit == "M" || unit == "MIB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GIB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  if (scale == 0 || !(v >= 0) || !std::isfinite(v)) return false;
  bytes = v * scale;
  return true;
}

std::string utc_now(bool compact) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, compact ? "%Y%m%d-%H%M%S" : "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string format_gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GB", bytes / 1e9);
  return b;
}

std::optional<double> parse_fraction(const std::string& text) {
  try {
    size_t used = 0;
    double v = std::stod(text, &used);
    if (used < text.size() && text.substr(used) == "%") v /= 100;
    else if (used != text.size()) return std::nullopt;
    return v;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace trainscope
