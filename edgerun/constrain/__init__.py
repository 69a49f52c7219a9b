"""Constrained decoding: grammars (JSON Schema, Lark, regex) that mask the next token, and tool calls on top."""

from .base import Constraint, apply_mask
from .grammar import Grammar, compile_constraint, grammar_from_options

__all__ = ["Constraint", "apply_mask", "Grammar", "compile_constraint", "grammar_from_options"]
