"""LLM serving: paged KV cache, pipeline stages, TD-Pipe scheduler, HTTP API."""
