"""The daemon's HTTP API: OpenAI-compatible completions, the admin API, metrics and health."""
