"""Stop strings found in time proportional to the new text, whatever their length or number.

An Aho-Corasick automaton over the stop strings, fed the generated text one character at a time.
Its state after the text so far is the longest suffix of that text which is a prefix of some stop
string: its depth is exactly the text a stream must hold back (it may still become a stop string),
and a state on which a stop string ends is a hit. Each character costs one transition plus
failure-link hops that the characters before it paid for, so the whole check is linear in the
text, where searching a window of the longest stop's length after every token was not.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    def __init__(self, stops: list[str]):
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._ends = [0]  # length of the longest stop string ending at this state (0: none)
        for s in stops:
            self._insert(s)
        self._link()
        self.state = 0
        self.work = 0  # transitions and failure-link hops taken: what the check cost (tests count it)

    def _insert(self, s: str) -> None:
        node = 0
        for ch in s:
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[node][ch] = nxt
                self._goto.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._ends.append(0)
            node = nxt
        if s:
            self._ends[node] = len(s)

    def _link(self) -> None:
        """Failure links breadth first: a state's link is its longest proper suffix in the trie."""
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[child] = self._goto[f].get(ch, 0)
                if not self._ends[child]:
                    self._ends[child] = self._ends[self._fail[child]]
                queue.append(child)

    @property
    def holdback(self) -> int:
        """Characters at the end of the text fed so far that may still begin a stop string."""
        return self._depth[self.state]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advance over `text`. On the first stop string that ends in it: (index in `text` just
        past its end, its length), the longest one ending there; None when none does."""
        goto, fail, ends = self._goto, self._fail, self._ends
        state = self.state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
                self.work += 1
            state = goto[state].get(ch, 0)
            self.work += 1
            if ends[state]:
                self.state = state
                return i + 1, ends[state]
        self.state = state
        return None
