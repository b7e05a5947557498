// Anchor for the shared precompiled header (torch + nlohmann_json); holds no code.
