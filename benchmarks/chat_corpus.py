"""Natural-text chat prompts for load tests, derived on any machine from a corpus every Python
ships: the prose of the Python language reference (`pydoc_data.topics`).

`chat_prompts(count, seed)` returns `count` single-turn chats, each an instruction (summarise,
explain, quiz, ...) over one passage of 80-150 words of the reference's prose (code samples and
grammar rules left out), about 150-300 tokens once rendered with a chat template. The same
`count` and `seed` give the same chats on every machine with the same Python minor version.
"""

from __future__ import annotations

import random
import re
from pydoc_data.topics import topics

INSTRUCTIONS = (
    "Summarise the following passage from the Python reference in three sentences.",
    "Explain the following passage to someone who is new to programming.",
    "Write three quiz questions, with answers, about the following passage.",
    "What are the key points of the following passage? Answer as a short list.",
    "Rewrite the following passage in plain, simple English.",
    "Give an example program that illustrates the following passage, and explain it.",
)
MIN_WORDS, MAX_WORDS = 80, 150


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of `text` that are prose: not indented (code, grammar), not headings."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or any(line.startswith((" ", "\t")) for line in lines):
            continue
        if all(set(line) <= set("*=-~^") for line in lines[1:]):
            continue  # a heading and its underline
        words = " ".join(lines).split()
        if len(words) >= 8:
            paragraphs.append(" ".join(words))
    return paragraphs


def passages() -> list[str]:
    """Consecutive prose paragraphs of each topic joined into passages of MIN..MAX words."""
    out = []
    for name in sorted(topics):
        current: list[str] = []
        for paragraph in prose_paragraphs(topics[name]):
            words = paragraph.split()
            if len(words) > MAX_WORDS:
                words = words[:MAX_WORDS]
            if sum(len(p.split()) for p in current) + len(words) > MAX_WORDS:
                if sum(len(p.split()) for p in current) >= MIN_WORDS:
                    out.append(" ".join(current))
                current = []
            current.append(" ".join(words))
        if sum(len(p.split()) for p in current) >= MIN_WORDS:
            out.append(" ".join(current))
    return out


def chat_prompts(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`count` chats (OpenAI `messages`), each an instruction over a passage, seeded."""
    rng = random.Random(seed)
    pool = passages()
    rng.shuffle(pool)
    chats = []
    for i in range(count):
        instruction = rng.choice(INSTRUCTIONS)
        passage = pool[i % len(pool)]
        chats.append([{"role": "user", "content": f"{instruction}\n\n{passage}"}])
    return chats
