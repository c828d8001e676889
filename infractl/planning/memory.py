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

    fp32:  16·b·s·h values of 4 bytes  (the block's input and the residual after attention, both
           norms' outputs, q/k/v (3h), the attention output, the MLP's up projection (4h) and
           its GELU (4h))
    bf16:  2·r + 28 bytes per b·s·h     (the two residual-stream tensors take r = 4 bytes, or 2
                                        under fsdp, which gathers its weights in bf16; the
                                        norms' outputs, q/k/v, attention and MLP outputs are bf16)

plus each norm's mean and reciprocal deviation (4·b·s values) and the attention's log-sum-exp
(b·a·s values), 4 bytes each. Activation checkpointing keeps only each block's input (b·s·h·r)
and recomputes one block at a time in the backward pass (its saves but its input, once more).
The head keeps the final norm's input and output and the log-softmax (b·s·V values of 4 bytes).
Under bf16, autocast keeps a bf16 copy of every matrix a linear layer uses (12h² per block and
the tied V·h embedding) until the backward pass.

The step's peak is not every component at once; what it holds was read off single-process
traces of the step (``torch.profiler`` with ``profile_memory``, every allocation with its
running total):

- the backward pass starts at the head, holding every save (A) and its transient T: the logits
  the step holds until its pass ends (b·s·V values, 2 bytes under bf16, else 4) and the loss's two
  fp32 gradients, cross-entropy's and log-softmax's (8·b·s·V bytes). Under activation
  checkpointing the recomputed block counted in A is not held yet then, and a recomputed block's
  MLP backward holds, beyond the saves counted and less the head's saves freed by then, 12·b·s·h
  bytes (fp32: the gradient entering the block, 4, GELU's output and input gradients, 16 each,
  less GELU's output freed, 16, and the head's norm outputs, 8; 12.0 to 12.5 measured) or
  7·b·s·h (bf16: 6.2 to 6.8 measured): T is the larger of the two moments;
- gradients are made as the saves are freed: at its first block the backward pass holds nearly
  all of them (G), the logits, that block's saves and its transient; AdamW's update (per tensor)
  then holds two temporaries the size of the largest tensor it updates (E, the larger of the two).
  The components are counted whole, and the ``overlap`` term takes off what the step never holds
  at once: max(A + T, G + E) − (A + T + G). A pipeline stage runs backward passes between its
  forwards and accumulates gradients across them: it keeps the sum.

Tensor parallel over t ranks (parallel.tp) splits each block's q/k/v, attention output and MLP
(their weights, the column-split biases, and the activations they save, the attention's
log-sum-exp included) t ways. Sequence parallel splits the residual stream along the tokens
inside the blocks, so the two residual-stream tensors (with activation checkpointing, the kept
block inputs) and the norms' statistics are split t ways too. The norms' outputs, gathered whole
for the column-split matrices that save them, stay whole on every rank, as do the embeddings, the
norms' weights, the row-split projections' biases and the head. Pipeline parallel over p stages
(parallel.pp) gives each stage L/p blocks; the budget is the largest stage's: the first stage's
weights (with both embeddings) and, as an upper bound, k micro-batches of b sequences each
through L/p blocks and the head, where k is how many micro-batches a stage holds at once
(``held``: all of them under gpipe, at most p under 1f1b). On such a mesh, ddp averages the
gradients over the data-parallel ranks in one flat all-reduce (a 4Ψᵣ copy, none on one rank)
instead of DDP's buckets, and fsdp shards over the data-parallel ranks only; Ψᵣ is one rank's
share of the parameters.

A fragmentation margin (10% of what is allocated and freed during a step: activations and
temporaries) and the runtime's reserve complete the budget. On a GPU the reserve is the CUDA
context and NCCL's buffers (1 GiB). On the CPU it is what a rank's process holds besides its
tensors, which only measurement tells: the peak `plan --measure` records (trainer/memprobe.py;
`python bench/planner_vs_peers.py RUN.yaml` probes a run file the same way) less the tensors
counted above, on 2 ranks of runs so small (1 to 12 blocks, 32 wide, 16 tokens, unless said) that
their tensors take under 2 MiB:

    34 MiB        every run: its data (4 MiB of stdlib text), Python's and libtorch's runtime (32.1
                  MiB measured for ddp, fp32, 1 block), and MKL's matrix-multiply buffers, which
                  grow with the matrices (0.3 MiB at 16 wide, 2.5 MiB at 256, single process)
    ⅛ MiB/block   each block's modules, hooks and small tensors (32.8 MiB at 6 blocks, 33.6 at 12)
    8 MiB         bf16: oneDNN makes a bf16 matrix kernel per shape and keeps it (6.6 MiB more
                  than fp32 measured; 5.2 to 8.6 MiB over shapes up to 256 wide, single process)
    2.5 MiB + 0.3 MiB/block   fsdp: FSDP2's per-parameter state and DTensor's caches (2.6 MiB more
                  than ddp at 1 block, 5.8 at 12)
    2.5 MiB + ⅛ MiB/block     tensor parallel: DTensor's caches (2.5 MiB more than ddp at 1 block,
                  3.8 at 12), and 0.4 MiB/block more with activation checkpointing (0.13 to 0.41
                  MiB/block measured, 32 to 128 wide)
    1.5 MiB       pipeline parallel: its schedule and torch.distributed.pipelining (1.2 MiB more)

These are this build's (torch 2.13, CPU) and this machine's; a different libtorch or CPU moves
them. What no term models, the measured band says: ``PEAK_BAND``, the peak's error over runs the
planner was not tuned on (generated by ``bench/planner_vs_peers.py --sweep``), which `infractl
plan` prints beside every prediction. Asynchronous checkpoint staging costs host memory: each
rank's share of the weights and optimizer state, once more.
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
    "ModelSplit",
    "Term",
    "parameters",
    "block_parameters",
    "rank_parameters",
    "held_microbatches",
    "budget",
    "terms",
]

VOCAB = 256
Scheme = Literal["ddp", "zero1", "zero2", "fsdp"]
SCHEMES: tuple[Scheme, ...] = ("ddp", "zero1", "zero2", "fsdp")
#: Data-parallel schemes the trainer runs (``parallel:`` in run.yaml); zero2 is sized, not trained.
RUNNABLE: tuple[Scheme, ...] = ("ddp", "zero1", "fsdp")

_FP32 = 4
_BF16 = 2
#: Bytes per b·s·h a block saves besides its two residual-stream tensors (see the module docstring).
_BLOCK_BYTES = {"fp32": 14 * _FP32, "bf16": 28}
#: Of those, the two norms' outputs: whole on every tensor-parallel rank, the rest is split.
_NORM_OUT_BYTES = {"fp32": 2 * _FP32, "bf16": 2 * _BF16}
#: Bytes per b·s·h of the final norm's output: fp32, or the bf16 copy autocast hands the head.
_HEAD_NORM_BYTES = {"fp32": _FP32, "bf16": _BF16}
#: Bytes per b·s·h a recomputed block's MLP backward holds beyond what is counted apart (the
#: module docstring): 12 derived for fp32 (12.0 to 12.5 measured), 6.2 to 6.8 measured for bf16.
_RECOMPUTED_BACKWARD_BYTES = {"fp32": 12, "bf16": 7}
_FRAGMENTATION = 0.10
#: What the runtime takes on a GPU before any tensor: the CUDA context and NCCL's buffers.
CUDA_RESERVE_BYTES = 1 << 30
_MIB = 1 << 20
#: What every rank's process holds on the CPU besides its tensors once a step has run; the other
#: terms of the CPU's reserve add to it (the module docstring says how each was measured).
CPU_RESERVE_BYTES = 34 * _MIB
_CPU_BLOCK_BYTES = _MIB // 8
_CPU_BF16_BYTES = 8 * _MIB
_CPU_FSDP_BYTES = 5 * _MIB // 2
_CPU_FSDP_BLOCK_BYTES = 3 * _MIB // 10
_CPU_TP_BYTES = 5 * _MIB // 2
_CPU_TP_RECOMPUTE_BYTES = 2 * _MIB // 5
_CPU_PP_BYTES = 3 * _MIB // 2


def block_parameters(hidden: int) -> int:
    """One transformer block: q/k/v and output projections, the MLP (4h), two norms."""
    return 12 * hidden * hidden + 13 * hidden


def parameters(model: ModelSpec) -> int:
    """Ψ of the trainer's GPT for ``model``."""
    h = model.hidden
    return VOCAB * h + model.seq_len * h + model.layers * block_parameters(h) + 2 * h


def _rank_block_parameters(hidden: int, tp: int) -> int:
    """One block's parameters on one of ``tp`` tensor-parallel ranks: the split matrices (12h²)
    and column-split biases (7h) over tp; the row-split projections' biases and the norms whole."""
    h = hidden
    return (12 * h * h + 7 * h) // tp + 6 * h


def rank_parameters(model: ModelSpec, *, tp: int = 1, pp: int = 1) -> int:
    """Ψᵣ: the parameters one rank holds under ``tp`` x ``pp`` before any data-parallel
    sharding; under a pipeline, the first stage's (the largest: it holds both embeddings)."""
    h = model.hidden
    root = VOCAB * h + model.seq_len * h + (2 * h if pp == 1 else 0)
    return root + model.layers // pp * _rank_block_parameters(h, tp)


def held_microbatches(pp: int, microbatches: int, schedule: str) -> int:
    """Micro-batches whose activations a pipeline stage holds at once, at most: all of them
    under gpipe, at most ``pp`` under 1f1b (1 without a pipeline)."""
    if pp == 1:
        return 1
    return microbatches if schedule == "gpipe" else min(pp, microbatches)


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
    overlap: int = 0
    """Bytes the components above count that the step never holds at once (gradients are made
    as the backward pass frees the saves); the total leaves them out."""

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        """The step's peak: every component, less what it never holds at once."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.temporary
            + self.fragmentation
            + self.reserve
            - self.overlap
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


@dataclass(frozen=True)
class ModelSplit:
    """How one copy of the model is split over ranks (run.yaml's ``parallel.tp``, ``parallel.pp``)."""

    tp: int = 1
    pp: int = 1
    held: int = 1
    """Micro-batches a pipeline stage holds at once (``held_microbatches``); 1 without one."""

    @property
    def meshed(self) -> bool:
        return self.tp > 1 or self.pp > 1


_WHOLE = ModelSplit()


def _residual_bytes(scheme: Scheme, precision: str) -> int:
    """Bytes of a residual-stream value: fsdp gathers its weights in bf16, so under bf16 the
    embeddings' output and the residual stream are bf16; autocast keeps them fp32."""
    return _BF16 if precision == "bf16" and scheme == "fsdp" else _FP32


def _block_saves(model: ModelSpec, *, scheme: Scheme, micro_batch: int, precision: str, tp: int) -> tuple[int, int]:
    """What one block saves on a rank (see the module docstring), and of that its input, the
    share of the residual stream activation checkpointing keeps."""
    b, s, h, a = micro_batch, model.seq_len, model.hidden, model.heads
    r = _residual_bytes(scheme, precision)
    norms = _NORM_OUT_BYTES[precision]
    # Under tensor parallel only the norms' outputs stay whole (see the module docstring).
    parted = 2 * r + _BLOCK_BYTES[precision] - norms
    per_layer = norms * b * s * h + parted * b * s * h // tp + _FP32 * (4 * b * s + b * a * s) // tp
    return per_layer, r * b * s * h // tp


def _activation_terms(
    model: ModelSpec, *, scheme: Scheme, micro_batch: int, precision: str, checkpointing: bool, split: ModelSplit
) -> list[Term]:
    b, s, h, a, t = micro_batch, model.seq_len, model.hidden, model.heads, split.tp
    L = model.layers // split.pp
    r = _residual_bytes(scheme, precision)
    norms = _NORM_OUT_BYTES[precision]
    parted = 2 * r + _BLOCK_BYTES[precision] - norms
    per_layer, kept = _block_saves(model, scheme=scheme, micro_batch=b, precision=precision, tp=t)
    if t == 1:
        layer_formula = (
            f"{norms + parted}·b·s·h + 4·(4·b·s + b·a·s) = {norms + parted}·{b}·{s}·{h} + 4·(4·{b}·{s} + {b}·{a}·{s})"
        )
    else:
        layer_formula = (
            f"{norms}·b·s·h + {parted}·b·s·h/t + 4·(4·b·s + b·a·s)/t = "
            f"{norms}·{b}·{s}·{h} + {parted}·{b}·{s}·{h}/{t} + 4·(4·{b}·{s} + {b}·{a}·{s})/{t}"
        )
    kept_formula, kept_numbers = f"{r}·b·s·h", f"{r}·{b}·{s}·{h}"
    if t > 1:
        kept_formula, kept_numbers = f"{kept_formula}/t", f"{kept_numbers}/{t}"
    norm = r + _HEAD_NORM_BYTES[precision]
    head = Term(
        "activations",
        "head (final norm's input and output, its statistics, log-softmax)",
        f"{norm}·b·s·h + 4·(2·b·s + b·s·V) = {norm}·{b}·{s}·{h} + 4·(2·{b}·{s} + {b}·{s}·{VOCAB})",
        norm * b * s * h + _FP32 * (2 * b * s + b * s * VOCAB),
    )
    if checkpointing:
        found = [
            Term(
                "activations",
                "block inputs kept by activation checkpointing",
                f"L·{kept_formula} = {L}·{kept_numbers}",
                L * kept,
            ),
            Term(
                "activations",
                "one block recomputed in the backward pass (its input is kept already)",
                f"{layer_formula} − {kept_formula}",
                per_layer - kept,
            ),
            head,
        ]
    else:
        found = [Term("activations", f"saved by {L} blocks ({precision})", f"L·({layer_formula})", L * per_layer), head]
    if split.held == 1:
        return found
    k = split.held
    return [Term(x.component, f"{x.what}, {k} micro-batches held", f"{k}·({x.formula})", k * x.bytes) for x in found]


def _model_state_terms(model: ModelSpec, *, scheme: Scheme, ranks: int, split: ModelSplit) -> list[Term]:
    psi = rank_parameters(model, tp=split.tp, pp=split.pp)
    name = "Ψᵣ" if split.meshed else "Ψ"
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
            found.append(Term(component, what, f"{per}{name}/N = {per}·{psi:,}/{ranks}", per * psi // ranks))
        else:
            found.append(Term(component, what, f"{per}{name} = {per}·{psi:,}", per * psi))
    return found


def _buffer_terms(model: ModelSpec, *, scheme: Scheme, ranks: int, precision: str, split: ModelSplit) -> list[Term]:
    """Temporary buffers of the scheme, and autocast's weight copies."""
    psi = rank_parameters(model, tp=split.tp, pp=split.pp)
    layers = model.layers // split.pp
    if scheme in ("ddp", "zero1") and split.meshed:
        # One data-parallel rank has no gradients to average, and no copy.
        found = []
        if ranks > 1:
            found.append(Term("temporary", "flat copy of the gradients to average", f"4Ψᵣ = 4·{psi:,}", _FP32 * psi))
    elif scheme in ("ddp", "zero1"):
        found = [Term("temporary", "DDP gradient buckets", f"4Ψ = 4·{psi:,}", _FP32 * psi)]
    elif scheme == "zero2":
        found = [Term("temporary", "gradient reduce buckets", f"4Ψ/N = 4·{psi:,}/{ranks}", _FP32 * psi // ranks)]
    else:
        gathered = _BF16 if precision == "bf16" else _FP32
        root = (VOCAB + model.seq_len + 2) * model.hidden
        block = _rank_block_parameters(model.hidden, split.tp)
        found = [
            Term(
                "temporary",
                "gathered root and two gathered blocks (one prefetched)",
                f"{gathered}·((V + s + 2)·h + 2·block) = {gathered}·({root:,} + 2·{block:,})",
                gathered * (root + 2 * block),
            ),
            Term("temporary", "one block's unsharded gradients", f"4·block = 4·{block:,}", _FP32 * block),
        ]
    if precision == "bf16" and scheme != "fsdp":
        copies = layers * 12 * model.hidden**2 // split.tp + VOCAB * model.hidden
        found.append(
            Term(
                "temporary",
                "autocast's bf16 copies of the matrices, kept for the backward pass",
                f"2·(L·12h²/t + V·h) = 2·{copies:,}",
                _BF16 * copies,
            )
        )
    return found


def _backward_term(
    model: ModelSpec, *, scheme: Scheme, micro_batch: int, precision: str, checkpointing: bool, tp: int
) -> Term:
    """The backward pass's transient tensors at its peak, beyond the saves and gradients counted
    apart (see the module docstring): the head's backward, or, under activation checkpointing,
    the larger of that and a recomputed block's backward."""
    b, s, h = micro_batch, model.seq_len, model.hidden
    logits = _BF16 if precision == "bf16" else _FP32
    head = (logits + 2 * _FP32) * b * s * VOCAB
    head_formula = f"({logits} + 8)·b·s·V"
    head_numbers = f"({logits} + 8)·{b}·{s}·{VOCAB}"
    if not checkpointing:
        return Term(
            "temporary",
            "the head's backward: the logits the step holds, the loss's two fp32 gradients",
            f"{head_formula} = {head_numbers}",
            head,
        )
    per_layer, kept = _block_saves(model, scheme=scheme, micro_batch=b, precision=precision, tp=tp)
    recomputed = per_layer - kept
    c = _RECOMPUTED_BACKWARD_BYTES[precision]
    block = c * b * s * h // tp
    parted = "/t" if tp > 1 else ""
    return Term(
        "temporary",
        "the backward pass's larger moment: the head's (which holds no recomputed block yet) or a "
        "recomputed block's MLP backward",
        f"max({head_formula} − recomputed block, {c}·b·s·h{parted}) = max({head:,} − {recomputed:,}, {block:,})",
        max(head - recomputed, block),
    )


def _overlap_term(
    model: ModelSpec, found: list[Term], *, scheme: Scheme, ranks: int, micro_batch: int, precision: str, tp: int
) -> Term:
    """What the sum of ``found`` counts that the step never holds at once (see the module
    docstring): the backward pass starts with the saves and its transient and no gradients, and
    reaches its first block holding nearly all of them; AdamW's update follows."""
    b, s, h = micro_batch, model.seq_len, model.hidden
    saves = sum(t.bytes for t in found if t.component == "activations")
    # Only the backward pass's own transient: the scheme's buffers and autocast's copies are held at either end.
    transient = found[-1].bytes
    gradients = sum(t.bytes for t in found if t.component == "gradients")
    per_layer, _ = _block_saves(model, scheme=scheme, micro_batch=b, precision=precision, tp=tp)
    logits = (_BF16 if precision == "bf16" else _FP32) * b * s * VOCAB
    first_block = logits + per_layer + _RECOMPUTED_BACKWARD_BYTES[precision] * b * s * h // tp
    # AdamW (per tensor) holds two temporaries the size of the largest tensor it updates: the
    # tied embedding or the MLP's up projection (split by tensor parallel, sharded by fsdp).
    largest = max(VOCAB * h, 4 * h * h // tp) // (ranks if scheme == "fsdp" else 1)
    end = max(first_block, 2 * _FP32 * largest)
    start = saves + transient
    return Term(
        "overlap",
        "the step never holds the above at once: the backward pass starts with the saves and its "
        "transient (A + T); at its first block it holds the gradients (G), the logits, that block's "
        "saves and transient, and AdamW's update two temporaries of its largest tensor (E, the larger)",
        f"max(A + T, G + E) − (A + T + G) = max({start:,}, {gradients:,} + {end:,}) − ({start:,} + {gradients:,})",
        max(start, gradients + end) - start - gradients,
    )


def _cpu_reserve_terms(
    model: ModelSpec, *, scheme: Scheme, precision: str, checkpointing: bool, split: ModelSplit
) -> list[Term]:
    """What a rank's process holds on the CPU besides the tensors (see the module docstring)."""
    blocks = model.layers // split.pp
    found = [
        Term("reserve", "the trainer's process: its data, libtorch's runtime, MKL's matrix buffers", "34 MiB",
             CPU_RESERVE_BYTES),
        Term("reserve", "each block's modules and hooks", f"L·⅛ MiB = {blocks}·⅛ MiB", blocks * _CPU_BLOCK_BYTES),
    ]  # fmt: skip
    if precision == "bf16":
        found.append(Term("reserve", "oneDNN's bf16 matrix kernels, made and kept per shape", "8 MiB", _CPU_BF16_BYTES))
    if scheme == "fsdp":
        found.append(
            Term(
                "reserve",
                "FSDP2's state and DTensor's caches",
                f"2.5 MiB + L·0.3 MiB = 2.5 MiB + {blocks}·0.3 MiB",
                _CPU_FSDP_BYTES + blocks * _CPU_FSDP_BLOCK_BYTES,
            )
        )
    if split.tp > 1:
        found.append(
            Term(
                "reserve",
                "DTensor's caches for the tensor-parallel plan",
                f"2.5 MiB + L·⅛ MiB = 2.5 MiB + {blocks}·⅛ MiB",
                _CPU_TP_BYTES + blocks * _CPU_BLOCK_BYTES,
            )
        )
        if checkpointing:
            found.append(
                Term(
                    "reserve",
                    "DTensor's state for each checkpointed block's recomputation",
                    f"L·0.4 MiB = {blocks}·0.4 MiB",
                    blocks * _CPU_TP_RECOMPUTE_BYTES,
                )
            )
    if split.pp > 1:
        found.append(Term("reserve", "the pipeline's schedule and what it imports", "1.5 MiB", _CPU_PP_BYTES))
    return found


def terms(
    model: ModelSpec,
    *,
    scheme: Scheme,
    ranks: int,
    micro_batch: int,
    precision: Literal["fp32", "bf16"] = "fp32",
    checkpointing: bool = False,
    cuda: bool = False,
    split: ModelSplit = _WHOLE,
) -> list[Term]:
    """Every number of the budget for ``scheme`` over ``ranks`` data-parallel ranks, each
    holding the part of the model ``split`` gives it, with its formula (see the module
    docstring). ``micro_batch``: sequences per forward pass (a pipeline's micro-batch)."""
    n = max(ranks, 1)
    found = _model_state_terms(model, scheme=scheme, ranks=n, split=split)
    found += _buffer_terms(model, scheme=scheme, ranks=n, precision=precision, split=split)
    found += _activation_terms(
        model, scheme=scheme, micro_batch=micro_batch, precision=precision, checkpointing=checkpointing, split=split
    )
    found.append(
        _backward_term(
            model, scheme=scheme, micro_batch=micro_batch, precision=precision, checkpointing=checkpointing, tp=split.tp
        )
    )
    if split.pp == 1:  # a pipeline stage's backward passes run between its forwards: the sum is its bound
        found.append(_overlap_term(model, found, scheme=scheme, ranks=n, micro_batch=micro_batch, precision=precision,
                                   tp=split.tp))  # fmt: skip
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
    else:
        found += _cpu_reserve_terms(model, scheme=scheme, precision=precision, checkpointing=checkpointing, split=split)
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
    split: ModelSplit = _WHOLE,
) -> Budget:
    """Bytes per device for ``scheme`` over ``ranks`` data-parallel ranks under ``split``, by
    component (``terms`` added up)."""
    found = terms(
        model,
        scheme=scheme,
        ranks=ranks,
        micro_batch=micro_batch,
        precision=precision,
        checkpointing=checkpointing,
        cuda=cuda,
        split=split,
    )
    totals = dict.fromkeys(
        ("parameters", "gradients", "optimizer", "activations", "temporary", "fragmentation", "reserve", "overlap"), 0
    )
    for term in found:
        totals[term.component] += term.bytes
    # The overlap term adds what the sum over-counts as a negative number; the Budget keeps it positive.
    totals["overlap"] = -totals["overlap"]
    return Budget(**totals)
