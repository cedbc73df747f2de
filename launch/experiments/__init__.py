"""Experiments run against a live fabric (`moe-fabric experiment ...`)."""
