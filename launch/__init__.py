"""The composition root: the `moe-fabric` command line, the local supervisor that starts and restarts
every role process, and the failure-injection experiments. Imports the role packages; nothing
imports it."""
