"""The expert worker process, which hosts (layer, expert) FFNs and batches tokens across AWs per layer."""
