"""The checkpoint store process, which holds host-memory KV checkpoints of every AW's live requests (Tarragon §6)."""
