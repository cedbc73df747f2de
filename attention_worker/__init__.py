"""The attention worker process: KV cache, attention, router, sampling, and the forwarding engine."""
