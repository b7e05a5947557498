#pragma once
// Human-readable numbers for terminal output (reports keep raw SI values).
#include <cstdint>
#include <optional>
#include <string>

namespace trainscope {

std::string format_bytes(double bytes);      // "1.5 MiB"
std::string format_seconds(double seconds);  // "812 us", "12.3 ms", "4.20 s", "3m05s"
std::string format_rate(double per_second);  // "1.23k", "4.5M"
std::string format_fixed(double v, int decimals);
std::string with_thousands(int64_t n);
std::string format_gb(double bytes);  // "69.8 GB" (1e9 bytes: how device memory is sold)
// "10%" -> 0.1, "0.1" -> 0.1; nullopt for anything else.
std::optional<double> parse_fraction(const std::string& text);  // "8,030,261,248"
std::string format_signed_pct(double pct, int decimals = 0);  // "+12%", "-3%"
// Parses "512MiB", "2GB", "1.5G", "4096" (bytes; K/M/G and KiB/MiB/GiB are powers of 1024, KB/MB/GB
// of 1000); false on anything else.
bool parse_bytes(const std::string& text, double& bytes);
// Current UTC time as ISO-8601 ("2026-12-02T14:09:44Z"); compact=true gives "20261202-140944".
std::string utc_now(bool compact = false);

}  // namespace trainscope
