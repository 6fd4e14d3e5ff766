"""Drafters propose k tokens inside the jitted step (no host round trip). See `base.Drafter`."""

from jspec.drafters.base import Drafter
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.mtp import MTPDrafter
from jspec.drafters.prompt_lookup import PromptLookup

__all__ = ["DraftModel", "Drafter", "MTPDrafter", "PromptLookup"]
