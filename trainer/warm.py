"""The warm workers' entrypoint as the agent hands it to torchrun (``trainer.agent``, run.yaml
``restart.warm``): a worker is forked from the node's fork server, which imported the trainer
already, and runs ``trainer.train.warm_main``. The agent passes this function instead of
``warm_main`` itself so that it never imports the trainer (torch's DCP and DTensor with it): that
costs the agent about 2.5 s of CPU on every launch and rejoin, for a module only its fork server
and workers run."""

from __future__ import annotations

__all__ = ["main"]


def main(*argv: str) -> None:
    """``trainer.train.warm_main(*argv)``, imported in the worker (from the fork server's modules)."""
    from trainer.train import warm_main

    warm_main(*argv)
