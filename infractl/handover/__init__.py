"""What the team takes away: the bundle (topology, configs, baselines, access, the reference and
the page that links them) and its runbooks."""
