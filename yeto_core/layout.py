"""Fragment layout: which trainable tensor syncs in which fragment (DESIGN §2).

Every learner and the syncer call ``build_layout`` on the same ordered list of ``TensorSpec``
(the model's trainable tensors, in parameter order) and must arrive at the same answer without
talking to each other, so the whole computation is a pure, deterministic function of its
inputs: no ``hash()``, no set or dict iteration order, ties broken by canonical position.

The result:

- The embedding tensors (input embedding and a tied LM head) form fragment 0 of their own, so
  the syncer can average them plainly while it merges every other fragment with RDA. With a
  single fragment there is nothing to split and everything lives in fragment 0.
- The remaining tensors are spread over the other fragments by one of ``PATTERNS``:
  ``binpack`` balances bytes (largest tensor first into the currently lightest fragment, a
  heap keyed ``(total numel, index)``, O(n log P)); ``strided`` sends transformer layer *i* to
  non-embedding fragment *i* mod B and bin-packs the tensors that belong to no layer.
- Inside a fragment the tensors keep canonical order and sit back to back from offset 0, so a
  fragment is one flat float32 buffer of ``Fragment.numel`` elements.

``layout_fingerprint`` is a SHA-256 over an unambiguous byte encoding of everything that
decides what a fragment's bytes mean; peers compare it on HELLO and refuse a mismatch.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
import struct
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "PATTERNS",
    "Fragment",
    "Layout",
    "TensorSlot",
    "TensorSpec",
    "build_layout",
    "layout_fingerprint",
    "specs_from_named_tensors",
    "transformer_layer_index",
]

PATTERNS = ("binpack", "strided")

# Bump when the encoding below changes, so old and new peers can never agree by accident.
_FINGERPRINT_TAG = b"yeto-layout-v1"
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# ".layers.7." (HF, Megatron "decoder.layers.7."), ".h.7." (GPT-2), ".blocks.7.", ".layer.7." (BERT).
# The first match wins, so an expert index further down ("...mlp.experts.3...") is not a layer.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One trainable tensor as every peer sees it: name, shape and dtype name.

    ``dtype`` is the torch dtype name without the ``torch.`` prefix (``"bfloat16"``), so that
    specs built from tensors and specs written by hand compare and fingerprint alike.
    ``embedding`` marks the input embedding and a tied LM head.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    embedding: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        # Accept any integer sequence (torch.Size, list) but store a plain tuple of ints, so
        # equality and the fingerprint do not depend on how the caller spelled the shape.
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {self.name!r} has a negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        if not self.dtype or self.dtype.startswith("torch."):
            raise ValueError(
                f"tensor {self.name!r}: dtype must be a torch dtype name without 'torch.' "
                f"(e.g. 'float32'), got {self.dtype!r}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor sits inside its fragment's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    embedding: bool


@dataclass(frozen=True, slots=True)
class Fragment:
    """One unit of synchronisation: its tensors in canonical order, back to back from 0."""

    index: int
    slots: tuple[TensorSlot, ...]
    numel: int
    embedding: bool


@dataclass(frozen=True)
class Layout:
    """The fragments of one model, and the fingerprint that peers compare on HELLO."""

    specs: tuple[TensorSpec, ...]
    pattern: str
    fragments: tuple[Fragment, ...]
    fingerprint: bytes
    _fragment_by_name: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {slot.name: frag.index for frag in self.fragments for slot in frag.slots}
        object.__setattr__(self, "_fragment_by_name", index)

    def fragment_of(self, name: str) -> int:
        """The index of the fragment that holds tensor ``name``."""
        try:
            return self._fragment_by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this layout") from None

    @property
    def assignment(self) -> tuple[int, ...]:
        """The fragment of every spec, in canonical order."""
        return tuple(self._fragment_by_name[s.name] for s in self.specs)

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def total_numel(self) -> int:
        return sum(f.numel for f in self.fragments)


def transformer_layer_index(name: str) -> int | None:
    """The transformer layer a tensor belongs to, or ``None`` (embeddings, final norm, head).

    ``"model.layers.7.mlp.up_proj.weight"`` → 7; also ``.h.3.``, ``.blocks.2.``,
    ``decoder.layers.5.``.
    """
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def specs_from_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]], embedding_names: Collection[str] = ()
) -> list[TensorSpec]:
    """Specs for ``named`` (e.g. ``model.named_parameters()``), keeping its order.

    Names in ``embedding_names`` are flagged as embeddings. A name listed there but absent from
    ``named`` is not an error: a tied LM head is usually deduplicated away by ``named_parameters``.
    """
    wanted = frozenset(embedding_names)
    return [
        TensorSpec(
            name=name,
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            embedding=name in wanted,
        )
        for name, t in named
    ]


def build_layout(specs: Sequence[TensorSpec], num_fragments: int, pattern: str = "binpack") -> Layout:
    """Split ``specs`` (canonical order) into ``num_fragments`` fragments with ``pattern``."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown layout pattern {pattern!r}; accepted: {', '.join(PATTERNS)}")
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"num_fragments must be an integer >= 1, got {num_fragments!r}")
    specs = tuple(specs)
    _check_unique_names(specs)

    n = len(specs)
    assignment = [0] * n
    split_embedding = num_fragments >= 2 and any(s.embedding for s in specs)
    # Non-embedding tensors fill bins first..num_fragments-1; fragment 0 is the embedding's own.
    first = 1 if split_embedding else 0
    others = [i for i, s in enumerate(specs) if not (split_embedding and s.embedding)]
    num_bins = num_fragments - first
    if len(others) < num_bins:
        raise _empty_fragment_error(n, num_fragments, split_embedding)

    if num_bins == 1:
        bins = [0] * len(others)
    elif pattern == "binpack":
        bins = _binpack([specs[i].numel for i in others], [0] * num_bins)
    else:
        bins = _strided(specs, others, num_bins)
    for i, b in zip(others, bins, strict=True):
        assignment[i] = first + b

    fragments = _fragments(specs, assignment, num_fragments, split_embedding)
    for frag in fragments:
        # An empty (or all-zero-size) fragment would be a round with nothing to send, and an
        # empty flat buffer that the codecs cannot view; refuse it where the cause is visible.
        if frag.numel == 0:
            raise _empty_fragment_error(n, num_fragments, split_embedding)
    fingerprint = layout_fingerprint(specs, assignment, num_fragments, pattern)
    return Layout(specs=specs, pattern=pattern, fragments=fragments, fingerprint=fingerprint)


def layout_fingerprint(
    specs: Sequence[TensorSpec], assignment: Sequence[int], num_fragments: int, pattern: str
) -> bytes:
    """SHA-256 (32 bytes) of P, the pattern and every spec's name, shape, dtype, flag, fragment.

    Every string is length-prefixed and every integer fixed-width little-endian, so no two
    different inputs share an encoding.
    """
    if len(assignment) != len(specs):
        raise ValueError(f"assignment has {len(assignment)} entries for {len(specs)} tensors")
    parts: list[bytes] = []
    _put_str(parts, _FINGERPRINT_TAG)
    parts.append(_U32.pack(num_fragments))
    _put_str(parts, pattern.encode())
    parts.append(_U64.pack(len(specs)))
    for spec, frag in zip(specs, assignment, strict=True):
        _put_str(parts, spec.name.encode())
        parts.append(_U32.pack(len(spec.shape)))
        parts.extend(_U64.pack(d) for d in spec.shape)
        _put_str(parts, spec.dtype.encode())
        parts.append(_U8.pack(1 if spec.embedding else 0))
        parts.append(_U32.pack(frag))
    return hashlib.sha256(b"".join(parts)).digest()


def _put_str(parts: list[bytes], raw: bytes) -> None:
    parts.append(_U32.pack(len(raw)))
    parts.append(raw)


def _check_unique_names(specs: Sequence[TensorSpec]) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"duplicate tensor name {s.name!r} in layout specs")
        seen.add(s.name)


def _empty_fragment_error(num_tensors: int, num_fragments: int, split_embedding: bool) -> ValueError:
    why = " (fragment 0 is reserved for the embedding)" if split_embedding else ""
    return ValueError(
        f"cannot split {num_tensors} tensors into {num_fragments} fragments without leaving a "
        f"fragment empty{why}; ask for fewer fragments"
    )


def _binpack(sizes: Sequence[int], loads: list[int]) -> list[int]:
    """Largest-first greedy into the lightest bin; returns a bin per size, in input order.

    ``loads`` holds the bins' starting totals. The heap key ``(load, bin)`` makes the smallest
    bin index win ties, and the stable sort on ``-size`` keeps canonical order among equal sizes,
    so the answer never depends on anything but the inputs.
    """
    heap = [(load, b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    out = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        load, b = heap[0]
        out[j] = b
        heapq.heapreplace(heap, (load + sizes[j], b))
    return out


def _strided(specs: Sequence[TensorSpec], others: Sequence[int], num_bins: int) -> list[int]:
    """Layer i to bin i mod B; tensors outside any layer then bin-packed onto those loads."""
    bins = [0] * len(others)
    loads = [0] * num_bins
    loose: list[int] = []  # positions in ``others`` without a layer index
    for pos, i in enumerate(others):
        layer = transformer_layer_index(specs[i].name)
        if layer is None:
            loose.append(pos)
        else:
            bins[pos] = layer % num_bins
            loads[bins[pos]] += specs[i].numel
    for pos, b in zip(loose, _binpack([specs[others[p]].numel for p in loose], loads), strict=True):
        bins[pos] = b
    return bins


def _fragments(
    specs: Sequence[TensorSpec], assignment: Sequence[int], num_fragments: int, split_embedding: bool
) -> tuple[Fragment, ...]:
    members: list[list[TensorSlot]] = [[] for _ in range(num_fragments)]
    offsets = [0] * num_fragments
    for spec, frag in zip(specs, assignment, strict=True):  # canonical order inside each fragment
        numel = spec.numel
        members[frag].append(TensorSlot(spec.name, spec.shape, offsets[frag], numel, spec.embedding))
        offsets[frag] += numel
    return tuple(
        Fragment(index=k, slots=tuple(members[k]), numel=offsets[k], embedding=split_embedding and k == 0)
        for k in range(num_fragments)
    )
