"""The orchestrator process, which handles registration, expert placement, the routing table and `GET /cluster`."""
