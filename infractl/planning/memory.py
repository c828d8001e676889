"""Bytes per device of a run, component by component: what `infractl plan` adds up.

The model is the trainer's GPT (trainer/model.py): vocabulary V = 256, hidden h, heads a, layers
L, sequence s; a micro batch of b sequences per data-parallel rank. Parameters:

    Ψ = V·h (token embedding, tied to the output) + s·h (positions) + L·(12h² + 13h) + 2h (final norm)

The trainer keeps fp32 weights, fp32 gradients and fp32 AdamW state (m and v) under every
precision: ``bf16`` is autocast (fsdp also gathers its weights in bf16). Per scheme, over N
data-parallel ranks:

    scheme   weights   gradients   optimizer   temporary
    ddp      4Ψ        4Ψ          8Ψ          4Ψ DDP gradient buckets
    zero1    4Ψ        4Ψ          8Ψ/N        4Ψ DDP gradient buckets
    zero2    4Ψ        4Ψ/N        8Ψ/N        4Ψ/N reduce buckets            (planner only)
    fsdp     4Ψ/N      4Ψ/N        8Ψ/N        the gathered root and two gathered blocks (one
                                               prefetched), and one block's unsharded fp32
                                               gradients before their reduce-scatter

Activations per layer are the tensors autograd saves for the backward pass, counted from the
block's operations (flash attention on CPU and GPU: no s×s score matrix is kept):

    fp32:  17·b·s·h values of 4 bytes  (input, norm output, q/k/v, attention output and its copy,
           second input, norm output, MLP up (4h) and its GELU (4h))
    bf16:  38·b·s·h bytes              (norms and the residual stream stay fp32; linear and
                                        attention outputs are bf16)

plus b·a·s·4 bytes of attention log-sum-exp. Activation checkpointing keeps only each block's
input (b·s·h·4) and recomputes one block at a time in the backward pass. The head keeps the
embedding sum and the final norm's input and output, the logits and their log-softmax
(2·b·s·h + 2·b·s·V values of 4 bytes), and the backward pass holds the logits' gradient.

A fragmentation margin (10% of what is allocated and freed during a step: activations and
temporaries) and the runtime's reserve (the CUDA context and NCCL buffers on a GPU) complete
the budget. Asynchronous checkpoint staging costs host memory: each rank's share of the
weights and optimizer state, once more.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from infractl.config import ModelSpec

__all__ = [
    "VOCAB",
    "Scheme",
    "SCHEMES",
    "RUNNABLE",
    "Budget",
    "Term",
    "parameters",
    "block_parameters",
    "budget",
    "terms",
]

VOCAB = 256
Scheme = Literal["ddp", "zero1", "zero2", "fsdp"]
SCHEMES: tuple[Scheme, ...] = ("ddp", "zero1", "zero2", "fsdp")
#: Schemes the trainer runs (``parallel:`` in run.yaml); zero2 is planned, not yet trained.
RUNNABLE: tuple[Scheme, ...] = ("ddp", "zero1", "fsdp")

_FP32 = 4
_BF16 = 2
#: Saved activation bytes per b·s·h per layer (see the module docstring).
_ACTIVATION_BYTES = {"fp32": 17 * _FP32, "bf16": 38}
_FRAGMENTATION = 0.10
#: What the runtime takes on a GPU before any tensor: the CUDA context and NCCL's buffers.
CUDA_RESERVE_BYTES = 1 << 30


def block_parameters(hidden: int) -> int:
    """One transformer block: q/k/v and output projections, the MLP (4h), two norms."""
    return 12 * hidden * hidden + 13 * hidden


def parameters(model: ModelSpec) -> int:
    """Ψ of the trainer's GPT for ``model``."""
    h = model.hidden
    return VOCAB * h + model.seq_len * h + model.layers * block_parameters(h) + 2 * h


@dataclass(frozen=True)
class Budget:
    """Bytes per device, by component."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    fragmentation: int
    reserve: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.temporary
            + self.fragmentation
            + self.reserve
        )

    def to_dict(self) -> dict[str, int]:
        return asdict(self) | {"total": self.total}


@dataclass(frozen=True)
class Term:
    """One number of the budget: its component, formula (with the inputs put in) and bytes."""

    component: str  # a Budget field
    what: str
    formula: str
    bytes: int


def _activation_terms(model: ModelSpec, *, micro_batch: int, precision: str, checkpointing: bool) -> list[Term]:
    b, s, h, a, L = micro_batch, model.seq_len, model.hidden, model.heads, model.layers
    per = _ACTIVATION_BYTES[precision]
    per_layer = per * b * s * h + _FP32 * b * a * s
    layer_formula = f"{per}·b·s·h + 4·b·a·s = {per}·{b}·{s}·{h} + 4·{b}·{a}·{s}"
    head = Term(
        "activations",
        "head (embedding sum, final norm, logits, log-softmax)",
        f"4·(2·b·s·h + 2·b·s·V) = 4·(2·{b}·{s}·{h} + 2·{b}·{s}·{VOCAB})",
        _FP32 * (2 * b * s * h + 2 * b * s * VOCAB),
    )
    if checkpointing:
        return [
            Term(
                "activations",
                "block inputs kept by activation checkpointing",
                f"L·4·b·s·h = {L}·4·{b}·{s}·{h}",
                L * _FP32 * b * s * h,
            ),
            Term("activations", "one block recomputed in the backward pass", layer_formula, per_layer),
            head,
        ]
    return [Term("activations", f"saved by {L} blocks ({precision})", f"L·({layer_formula})", L * per_layer), head]


def terms(
    model: ModelSpec,
    *,
    scheme: Scheme,
    ranks: int,
    micro_batch: int,
    precision: Literal["fp32", "bf16"] = "fp32",
    checkpointing: bool = False,
    cuda: bool = False,
) -> list[Term]:
    """Every number of the budget for ``scheme`` over ``ranks`` data-parallel ranks, with its
    formula (see the module docstring)."""
    psi = parameters(model)
    n = max(ranks, 1)
    sharded = {
        "ddp": (),
        "zero1": ("optimizer",),
        "zero2": ("optimizer", "gradients"),
        "fsdp": ("optimizer", "gradients", "parameters"),
    }[scheme]
    found = []
    for component, what, per in (
        ("parameters", "fp32 weights", 4),
        ("gradients", "fp32 gradients", 4),
        ("optimizer", "AdamW m and v, fp32", 8),
    ):
        if component in sharded:
            found.append(Term(component, what, f"{per}Ψ/N = {per}·{psi:,}/{n}", per * psi // n))
        else:
            found.append(Term(component, what, f"{per}Ψ = {per}·{psi:,}", per * psi))
    if scheme in ("ddp", "zero1"):
        found.append(Term("temporary", "DDP gradient buckets", f"4Ψ = 4·{psi:,}", _FP32 * psi))
    elif scheme == "zero2":
        found.append(Term("temporary", "gradient reduce buckets", f"4Ψ/N = 4·{psi:,}/{n}", _FP32 * psi // n))
    else:
        gathered = _BF16 if precision == "bf16" else _FP32
        root = (VOCAB + model.seq_len + 2) * model.hidden
        block = block_parameters(model.hidden)
        found.append(
            Term(
                "temporary",
                "gathered root and two gathered blocks (one prefetched)",
                f"{gathered}·((V + s + 2)·h + 2·(12h² + 13h)) = {gathered}·({root:,} + 2·{block:,})",
                gathered * (root + 2 * block),
            )
        )
        found.append(
            Term("temporary", "one block's unsharded gradients", f"4·(12h² + 13h) = 4·{block:,}", _FP32 * block)
        )
    if precision == "bf16" and scheme != "fsdp":
        linear = model.layers * block_parameters(model.hidden)
        found.append(
            Term(
                "temporary", "autocast's bf16 copies of the weights", f"2·L·(12h² + 13h) = 2·{linear:,}", _BF16 * linear
            )
        )
    found += _activation_terms(model, micro_batch=micro_batch, precision=precision, checkpointing=checkpointing)
    b, s = micro_batch, model.seq_len
    found.append(Term("temporary", "the logits' gradient", f"4·b·s·V = 4·{b}·{s}·{VOCAB}", _FP32 * b * s * VOCAB))
    dynamic = sum(t.bytes for t in found if t.component in ("activations", "temporary"))
    found.append(
        Term(
            "fragmentation",
            "allocator margin",
            f"10% of activations and temporaries = 0.1·{dynamic:,}",
            int(_FRAGMENTATION * dynamic),
        )
    )
    if cuda:
        found.append(Term("reserve", "CUDA context and NCCL buffers", "1 GiB", CUDA_RESERVE_BYTES))
    return found


def budget(
    model: ModelSpec,
    *,
    scheme: Scheme,
    ranks: int,
    micro_batch: int,
    precision: Literal["fp32", "bf16"] = "fp32",
    checkpointing: bool = False,
    cuda: bool = False,
) -> Budget:
    """Bytes per device for ``scheme`` over ``ranks`` data-parallel ranks, by component."""
    found = terms(
        model,
        scheme=scheme,
        ranks=ranks,
        micro_batch=micro_batch,
        precision=precision,
        checkpointing=checkpointing,
        cuda=cuda,
    )
    totals = {
        f: 0 for f in ("parameters", "gradients", "optimizer", "activations", "temporary", "fragmentation", "reserve")
    }
    for term in found:
        totals[term.component] += term.bytes
    return Budget(**totals)
