"""Which fragments an island waits for at their boundary (DESIGN §3.4, Factored Gossip's Mix2).

Most fragments are non-blocking: a learner pushes and trains on, installing the merged value
whenever it arrives. A few are worth waiting for, because islands drift apart fastest there: the
embedding, the LM head, the first layers. `YETO_DILOCO_BLOCKING` names them:

    embedding      the fragment(s) holding the input embedding (and a tied head)
    head           the fragment(s) holding an untied output head (lm_head, output_layer, embed_out)
    layers:N       the fragment(s) holding any tensor of transformer layers 0 … N−1
    3              fragment 3

comma-separated, e.g. `embedding,head,layers:2`.
"""

from __future__ import annotations

import re

from yeto_core.layout import Layout, transformer_layer_index

__all__ = ["blocking_fragments", "parse_blocking"]

_HEAD = re.compile(r"(?:^|\.)(?:lm_head|output_layer|embed_out)(?:\.|$)")
_LAYERS = re.compile(r"^layers:(\d+)$")


def parse_blocking(spec: str) -> list[str]:
    """The spec's items, checked; raises ValueError naming a bad item."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    for item in items:
        if item not in ("embedding", "head") and not _LAYERS.match(item) and not item.isdigit():
            raise ValueError(f"unknown blocking item {item!r}: use embedding, head, layers:N or a fragment index")
    return items


def blocking_fragments(layout: Layout, spec: str) -> frozenset[int]:
    """The fragment indices `spec` names in `layout`."""
    out: set[int] = set()
    for item in parse_blocking(spec):
        if item.isdigit():
            if int(item) >= layout.num_fragments:
                raise ValueError(f"blocking fragment {item} does not exist ({layout.num_fragments} fragments)")
            out.add(int(item))
            continue
        layers = _LAYERS.match(item)
        for fragment in layout.fragments:
            for slot in fragment.slots:
                layer = transformer_layer_index(slot.name)
                if ((item == "embedding" and slot.embedding) or (item == "head" and _HEAD.search(slot.name))
                        or (layers is not None and layer is not None and layer < int(layers.group(1)))):
                    out.add(fragment.index)
    return frozenset(out)
