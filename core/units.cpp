#include "core/units.hpp"

#include <cmath>
#include <cstdio>
#include <ctime>

namespace trainscope {

std::string format_fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
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

std::string utc_now(bool compact) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, compact ? "%Y%m%d-%H%M%S" : "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace trainscope
