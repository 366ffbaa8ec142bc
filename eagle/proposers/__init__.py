"""Drafting methods for the speculative decoding engine (`eagle.engine`)."""

from eagle.engine import Proposer, VanillaProposer
from eagle.proposers.draft_model import DraftLM
from eagle.proposers.eagle import eagle_proposer as eagle_proposer
from eagle.proposers.medusa import medusa_proposer as medusa_proposer
from eagle.proposers.prompt_lookup import PromptLookupProposer
from eagle.proposers.template import TemplateProposer, TreeDraftModel

__all__ = ["DraftLM", "PromptLookupProposer", "Proposer", "TemplateProposer", "TreeDraftModel",
           "VanillaProposer"]
