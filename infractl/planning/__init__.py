"""Planning: how much memory a run needs and where it fits (``plan``), measured against a real run."""
