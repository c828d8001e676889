"""Layout maths the control plane and the trainer share: how a global batch splits over the
data-parallel ranks, and whether a run's ``parallel`` layout runs on each world size it may meet."""

from __future__ import annotations

import math
from collections.abc import Iterable

from infractl.config.run import RunSpec
from infractl.errors import ConfigError

__all__ = ["check_layout", "even_passes", "micro_batch", "split_batch"]


def split_batch(batch_size: int, parts: int) -> list[int]:
    """Samples each of ``parts`` data-parallel ranks takes of a global batch of ``batch_size``:
    as even as can be, the first ``batch_size % parts`` ranks one more than the rest."""
    if parts < 1:
        raise ValueError("parts must be at least 1")
    base, extra = divmod(batch_size, parts)
    return [base + (i < extra) for i in range(parts)]


def micro_batch(spec: RunSpec, *, world_size: int, max_world_size: int) -> int:
    """Samples in a rank's largest forward/backward pass on a world of ``world_size`` ranks, for a
    run that may grow to ``max_world_size``: a pipeline's micro-batch (its share of the batch over
    ``parallel.microbatches``), else sized for the largest world, so that a smaller one
    accumulates more passes of the same size instead of larger ones. ``micro_batch`` in run.yaml
    caps it: a share larger than the cap takes as few passes as keep under it, as even as can be
    (a share of 48 under a cap of 20 takes 3 passes of 16)."""
    parallel = spec.parallel
    dp = parallel.dp_degree(world_size)
    if parallel.pp > 1:
        return split_batch(spec.batch_size, dp)[0] // parallel.n_microbatches
    share = math.ceil(spec.batch_size / max(dp, max_world_size // parallel.model_ranks))
    return even_passes(share, spec.micro_batch)


def even_passes(share: int, cap: int | None) -> int:
    """The largest pass of ``share`` samples split as evenly as can be into the fewest passes of
    at most ``cap`` samples (None: one pass)."""
    if cap is None or share <= cap:
        return share
    return math.ceil(share / math.ceil(share / cap))


def check_layout(spec: RunSpec, worlds: Iterable[tuple[int, str]], *, file: str) -> None:
    """ConfigError naming the field unless ``spec.parallel`` runs on every world size of
    ``worlds``: (ranks, how that many ranks arise, e.g. "3 node(s) x 1 process(es)")."""
    parallel = spec.parallel
    for ranks, how in worlds:
        try:
            dp = parallel.dp_degree(ranks)
        except ValueError as exc:
            raise ConfigError(f"{exc} ({how})", file=file, field="parallel") from None
        if spec.batch_size < dp:
            raise ConfigError(
                f"{spec.batch_size} is smaller than the {dp} data-parallel rank(s) of {how}: a rank would idle",
                file=file,
                field="batch_size",
            )
        micro = parallel.n_microbatches
        if parallel.pp > 1 and spec.batch_size % (dp * micro):
            raise ConfigError(
                f"{spec.batch_size} does not split into {dp} data-parallel rank(s) x {micro} pipeline "
                f"micro-batches of equal size ({how}); the pipeline needs equal micro-batches",
                file=file,
                field="batch_size",
            )
