"""Scaling: how a run's throughput grows with nodes and where step time goes (``bench``), with its
plots and the baseline it writes to the store."""
