"""The multi-turn chat workload: conversations that share a system prompt, several turns each,
every turn resending the whole conversation so far; conversations arrive as a Poisson process and
each next turn follows the previous answer after a think time.

Pure and deterministic for a given seed, so every arm replays the same conversations (the
answers come from the model: greedy, so every arm gets the same ones when outputs are equal).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from bench.lib.workload import make_prompt, poisson_arrivals


@dataclass(frozen=True)
class ChatSpec:
    name: str
    conversations: int
    turns: int
    system_tokens: int  # the shared system prompt
    user_tokens: tuple[int, int]  # inclusive range of each user message
    output_len: int  # max_tokens of every answer (ignore_eos: every answer is this long)
    rate: float  # conversations started per second (Poisson)
    think_s: float  # mean pause between an answer and the next question (exponential)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1:
            raise ValueError("a chat workload needs at least one conversation of one turn")
        if self.rate <= 0 or self.think_s < 0:
            raise ValueError("rate must be > 0 and think_s >= 0")
        if not 1 <= self.user_tokens[0] <= self.user_tokens[1]:
            raise ValueError(f"bad user_tokens range {self.user_tokens}")


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float  # when its first turn is sent
    user_messages: tuple[str, ...]  # one per turn
    think_s: tuple[float, ...]  # pause before each turn after the first (first: 0)


@dataclass(frozen=True)
class ChatPlan:
    spec: ChatSpec
    system: str
    conversations: tuple[Conversation, ...]

    def request_index(self, conversation: int, turn: int) -> int:
        """One number per request, the same in every arm (RequestRecord.index)."""
        return conversation * self.spec.turns + turn


def plan_chat(spec: ChatSpec, count_tokens: Callable[[str], int]) -> ChatPlan:
    """The conversations every arm replays for this workload."""
    rng = random.Random(f"chat-{spec.seed}")
    system = make_prompt(count_tokens, spec.system_tokens, seed=spec.seed * 7919 + 1)
    starts = poisson_arrivals(spec.rate, spec.conversations, spec.seed)
    convs = []
    for c, start in enumerate(starts):
        users = tuple(make_prompt(count_tokens, rng.randint(*spec.user_tokens), seed=spec.seed * 100003 + c * 101 + t)
                      for t in range(spec.turns))
        thinks = (0.0, *(rng.expovariate(1 / spec.think_s) if spec.think_s else 0.0 for _ in range(spec.turns - 1)))
        convs.append(Conversation(c, start, users, thinks))
    return ChatPlan(spec, system, tuple(convs))


def messages_for(plan: ChatPlan, conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The whole conversation up to the next turn: system, then each question and its answer so
    far, then the next question (turn = len(answers))."""
    msgs = [{"role": "system", "content": plan.system}]
    for q, a in zip(conversation.user_messages, answers, strict=False):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": conversation.user_messages[len(answers)]})
    return msgs
