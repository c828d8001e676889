"""The trainer image: built here (``build``), found in the image cache by digest (``locate``),
copied to a registry by digest (``push``), and served to a cluster's nodes by the cluster's own
registry (``registry``)."""

from __future__ import annotations

from infractl.image.build import FLAVOURS, BuiltImage, build, cache_root, infractl_wheel, locate, lock_path, push

__all__ = ["FLAVOURS", "BuiltImage", "build", "cache_root", "infractl_wheel", "locate", "lock_path", "push"]
