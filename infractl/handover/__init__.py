"""What the team takes away: the bundle, access, runbooks, the exported model."""
