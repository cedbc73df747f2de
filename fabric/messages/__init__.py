"""Typed messages, one module per channel. See `base.py` for how they travel."""

from __future__ import annotations

from fabric.messages.base import Message, decode_message, encode_message

__all__ = ["Message", "decode_message", "encode_message"]
