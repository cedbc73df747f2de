"""The host-memory weight store process (`moe-fabric weight-store`)."""
