"""The `duet` commands, one module per group; each module's `add(sub)` adds its sub-commands
to the parser (`duet.cli.parser`)."""
