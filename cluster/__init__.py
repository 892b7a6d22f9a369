"""The serving cluster: configuration, scheduler, the central engine actor, serving and the CLI."""
