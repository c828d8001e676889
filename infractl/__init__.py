"""infractl: provision nodes, configure them, run fault-tolerant multi-node PyTorch training."""

__version__ = "0.1.0"
