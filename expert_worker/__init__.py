"""The expert worker process: hosts (layer, expert) FFNs and batches tokens across AWs per layer."""
