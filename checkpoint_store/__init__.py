"""Checkpoint store process: host-memory KV checkpoints of every AW's live requests (Tarragon §6)."""
