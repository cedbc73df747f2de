"""The gateway process, an OpenAI-compatible HTTP front door that spreads requests over AWs."""
