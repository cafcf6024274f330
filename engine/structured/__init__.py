"""Structured outputs: constraints on what a request may generate (a JSON schema, any JSON
object, a tagged tool-call format), compiled once into a token grammar and enforced as a mask on
every logit row the request samples from, verify rows included.

- `spec.StructuredOutput`: what a request asks for (immutable, part of `SamplingParams`).
- `compiler.GrammarCompiler`: compiles it against the model's tokenizer, cached, thread-safe, so
  the server compiles off the engine thread and the engine finds the result cached.
- `state.GrammarState`: one sequence's position in its grammar: the allowed-token mask, accept,
  rollback (rejected drafts), and the tokens the grammar forces (free drafts).
"""

from engine.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
