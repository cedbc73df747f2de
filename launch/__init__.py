"""The composition root.

It holds the `moe-fabric` command line, the local supervisor that starts and restarts every role
process, and the failure-injection experiments. It imports the role packages. Nothing imports it."""
