"""The gateway process: the OpenAI-compatible HTTP front door; spreads requests over AWs."""
