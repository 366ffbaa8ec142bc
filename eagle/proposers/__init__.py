"""Drafting methods for the speculative decoding engine (`eagle.decoding.engine`)."""

from eagle.decoding.engine import Proposer, VanillaProposer
from eagle.proposers.draft_model import DraftLM
from eagle.proposers.eagle import EagleDraftModel, eagle_proposer
from eagle.proposers.medusa import MedusaDraftModel, medusa_proposer
from eagle.proposers.prompt_lookup import PromptLookupProposer
from eagle.proposers.template import TemplateProposer, TreeDraftModel

__all__ = [
    "DraftLM",
    "EagleDraftModel",
    "MedusaDraftModel",
    "PromptLookupProposer",
    "Proposer",
    "TemplateProposer",
    "TreeDraftModel",
    "VanillaProposer",
    "eagle_proposer",
    "medusa_proposer",
]
