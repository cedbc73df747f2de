"""The attention worker process, which holds the KV cache, attention, router, sampling and the forwarding engine."""
