"""The orchestrator process: registration, expert placement, the routing table, `GET /cluster`."""
