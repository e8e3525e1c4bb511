"""Readers for multiple-choice questions: score a retrieved context by the answers it allows.

QuALITY-style questions have no gold evidence, only answer options and the index of the
correct one, so a context can only be judged by what a reader answers from it.  That is the
RAPTOR paper's QuALITY measure: a reader model's accuracy with each retriever's context at
the same budget.

Only a language model reads well enough for this.  An offline reader built on the embedding
model (each option scored by its best cosine similarity to a sentence of the context) was
measured on the 609 QuALITY questions of the shared evaluation data and stayed at chance:
0.28 with the whole article as context against 0.25 for a random pick (QuALITY's wrong
options are written to resemble the text), so none is offered.  Use
:class:`LLMChoiceReader` with a real model (``raptor eval --reader llm``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from raptor_core.evaluation.metrics import normalize
from raptor_core.exceptions import InvalidParameterError, LLMError
from raptor_core.types import LLM

__all__ = ["CHOICE_PROMPT", "ChoiceReader", "LLMChoiceReader", "parse_choice"]

#: Letters that name the options in the prompt, in order.
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

#: The reader's prompt; ``{context}``, ``{question}`` and ``{options}`` are filled in.
CHOICE_PROMPT = """Read the context, then answer the multiple-choice question about it.
Reply with the letter of the best option and nothing else.

Context:
{context}

Question: {question}
{options}

Answer:"""

# "B", "(B)", "B.", "B) text", "**B**": a letter standing alone at the start of the reply.
_LEADING = re.compile(r"\W*([A-Z])(?![A-Za-z0-9])")
# "The answer is B", "Answer: (C)", "option D".
_NAMED = re.compile(r"(?i:answer|option|choice)(?:\s+is)?\W*([A-Z])(?![A-Za-z0-9])")


@runtime_checkable
class ChoiceReader(Protocol):
    """Answers a multiple-choice question from a context: the index of the chosen option."""

    def choose(self, question: str, options: Sequence[str], context: Sequence[str]) -> int:
        """The index (from 0) of the option that ``context`` supports."""
        ...


def parse_choice(reply: str, options: Sequence[str]) -> int:
    """The option a reader's reply names: by its letter, or by repeating the option's text.

    Examples:
        >>> parse_choice("B", ["yes", "no"])
        1
        >>> parse_choice("The answer is (A).", ["yes", "no"])
        0
        >>> parse_choice("no", ["yes", "no"])
        1

    Raises:
        LLMError: the reply names no option (empty, a letter past the options, chatter).
    """
    text = reply.strip() if isinstance(reply, str) else ""
    # The option's own text first: "A rebellion broke out" is an option, not a letter.
    said = normalize(text)
    same = [i for i, option in enumerate(options) if said and normalize(option) == said]
    if len(same) == 1:
        return same[0]
    for found in (_LEADING.match(text), _NAMED.search(text)):
        if found is not None and _LETTERS.index(found.group(1)) < len(options):
            return _LETTERS.index(found.group(1))
    msg = (
        f"the reader's answer {text[:80]!r} names none of the options "
        f"{_LETTERS[0]}-{_LETTERS[len(options) - 1]}: use a model that follows the "
        "instruction to reply with a letter, or a larger answer length"
    )
    raise LLMError(msg)


class LLMChoiceReader:
    """A language model as the reader: prompted with the context, it names an option's letter.

    One call per question, retriever and budget.  A reply that names no option is asked
    once more; if the second names none either, :class:`~raptor_core.exceptions.LLMError`
    is raised (the evaluation counts it as a failure of that question, not as a guess).

    Args:
        llm: the reader model (any :class:`~raptor_core.types.LLM`).
        prompt: the template (:data:`CHOICE_PROMPT`), with ``{context}``, ``{question}`` and
            ``{options}`` placeholders.
        max_tokens: answer length passed to the model (a letter needs one token; some
            models preface it).

    Examples:
        >>> from raptor_core.testing import ScriptedLLM
        >>> reader = LLMChoiceReader(ScriptedLLM(default="B"))
        >>> reader.choose("Who won?", ["the hare", "the tortoise"], ["The tortoise won."])
        1
    """

    def __init__(self, llm: LLM, *, prompt: str = CHOICE_PROMPT, max_tokens: int = 16) -> None:
        self.llm = llm
        self.prompt = prompt
        self.max_tokens = max_tokens

    def __repr__(self) -> str:
        return f"LLMChoiceReader(llm={self.llm!r}, max_tokens={self.max_tokens!r})"

    def _check(self, options: Sequence[str]) -> None:
        if not 2 <= len(options) <= len(_LETTERS):
            msg = (
                f"a multiple-choice question needs 2 to {len(_LETTERS)} options, got {len(options)}"
            )
            raise InvalidParameterError(msg)
        size = self.max_tokens
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            msg = f"max_tokens must be a positive integer, got {size!r}"
            raise InvalidParameterError(msg)
        for name in ("{context}", "{question}", "{options}"):
            if not isinstance(self.prompt, str) or name not in self.prompt:
                msg = f"the reader prompt must contain {name}"
                raise InvalidParameterError(msg)

    def render(self, question: str, options: Sequence[str], context: Sequence[str]) -> str:
        """The prompt for one question (context passages separated by blank lines)."""
        lines = "\n".join(
            f"{_LETTERS[i]}. {' '.join(option.split())}" for i, option in enumerate(options)
        )
        body = "\n\n".join(text.strip() for text in context if text.strip()) or "(empty)"
        # One pass over the template, so text inside the context is never taken for a
        # placeholder.
        values = {"{context}": body, "{question}": question.strip(), "{options}": lines}
        return re.sub(r"\{context\}|\{question\}|\{options\}", lambda m: values[m[0]], self.prompt)

    def choose(self, question: str, options: Sequence[str], context: Sequence[str]) -> int:
        """The index of the option the model names.

        Raises:
            LLMError: the model failed, or named no option twice.
            InvalidParameterError: fewer than two options, or a bad ``max_tokens``/prompt.
        """
        self._check(options)
        prompt = self.render(question, options, context)
        reply = self.llm.complete(prompt, max_tokens=self.max_tokens)
        try:
            return parse_choice(reply, options)
        except LLMError:
            pass  # a reply that names no option is asked for once more
        return parse_choice(self.llm.complete(prompt, max_tokens=self.max_tokens), options)
