"""Medusa-1 drafting: the heads fill a sparse tree template from their top-k.

Once per round the K heads read the target's feature of the last accepted node,
`state.new_features[:, -1]`: the feature whose LM head produced the root token x_{t+1}.
Head d then predicts the token at depth d (x_{t+d+1}), so the node at depth d with rank r
takes the r-th most likely token of head d, the same token under every parent at that
depth (docs/design.md §4; Medusa's "cartesian product of the heads' top-k", trimmed to a
template). The heads never see the draft tokens, so there is nothing to run per depth.

This is a `TreeDraftModel` for `TemplateProposer`, which does the filling and records each
node's proposal q exactly (a one-hot for the deterministic top-k), so the engine's exact
verification stays exact. The per-node state a node hands its children is the stack of
logits of the heads below its depth: a depth-d node's children read head d + 1's row.
With `proposal="sample"` each parent draws its own children from that head's distribution
(still exact, but siblings under different parents may then differ).
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle.decoding.engine import DecodeState
from eagle.models.medusa import MedusaError, MedusaHeads
from eagle.proposers.template import TemplateProposer
from eagle.tree import TreeTemplate


class MedusaDraftModel:
    """Medusa heads as a `TreeDraftModel` (see `eagle.proposers.template`); it has no cache."""

    def __init__(self, heads: MedusaHeads):
        self.heads = heads.eval()  # drafting is inference

    @property
    def dtype(self) -> torch.dtype:
        return self.heads.dtype

    def reset(self, state: DecodeState) -> None:
        pass

    def fork(self) -> MedusaDraftModel:
        return self  # no state: the heads read the state's features

    def end_round(self) -> None:
        pass

    def catch_up(self, state: DecodeState) -> tuple[Tensor, Tensor]:
        """Run every head once on the feature that produced the root token.

        Returns:
            head 1's logits (V,) (the root's children) and the other heads' (K-1, V).
        """
        logits = self.heads(state.new_features[0, -1])  # (K, V)
        return logits[0], logits[1:]

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             visible: Tensor) -> tuple[Tensor, Tensor]:
        """n nodes at one depth d: their children come from head d + 1, the first row of the
        heads their parents left them (n, K-d, V); no forward is needed."""
        return parent_hidden[:, 0], parent_hidden[:, 1:]

    # Several sequences at once (`eagle.proposers.template.RowsDraftModel`): one pass of the heads.

    batches_rows = True

    def begin_rows(self, states) -> None:
        pass

    def catch_up_rows(self, states) -> tuple[Tensor, Tensor]:
        """Every head on each sequence's last feature: head 1's logits (B, V), the others' (B, K-1,
        V)."""
        logits = self.heads(torch.cat([s.new_features[:, -1] for s in states])).transpose(
            0, 1
        )  # (K, B, V) -> (B, K, V)
        return logits[:, 0], logits[:, 1:]

    def step_rows(
        self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor, visible: Tensor
    ) -> tuple[Tensor, Tensor]:
        return parent_hidden[:, :, 0], parent_hidden[
            :, :, 1:
        ]  # (B, n, K-d, V) -> head d + 1's rows

    def end_round_rows(self, keep) -> None:
        pass


def medusa_proposer(
    heads: MedusaHeads, template: TreeTemplate, proposal: str = "topk"
) -> TemplateProposer:
    """Medusa-1 drafting of `template` (depth <= number of heads)."""
    if template.depth > heads.num_heads:
        raise MedusaError(
            f"tree {template.name!r} is {template.depth} deep but there are only "
            f"{heads.num_heads} Medusa heads (head d fills depth d): use a tree of depth "
            f"<= {heads.num_heads} or heads trained with more"
        )
    return TemplateProposer(MedusaDraftModel(heads), template, proposal=proposal, name="medusa")
