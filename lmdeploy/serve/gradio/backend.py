"""What the chat page asks of an engine, whichever side of an HTTP connection it is on.

A browser tab owns one :class:`ChatSession`: its turns live in one interactive engine session (the KV
cache of earlier turns stays in the engine, so a turn sends only the new message), ``stop`` cancels the
turn being generated, ``reset`` frees the engine session."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional


@dataclass
class ChatSettings:
    """The page's sliders and system prompt; the system prompt opens a conversation (turn 0)."""
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.9
    system_prompt: str = ''

    def check(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f'max new tokens must be a positive integer, got {self.max_new_tokens!r}')
        if not 0 <= self.temperature <= 2:
            raise ValueError(f'temperature must be in [0, 2], got {self.temperature}')
        if not 0 < self.top_p <= 1:
            raise ValueError(f'top-p must be in (0, 1], got {self.top_p}')


@dataclass
class ChatSession:
    """One browser tab's conversation. ``session_id`` is the engine's (local) or the server's client id
    (remote, with ``session_token``, what reaches the server's session); ``turns`` counts finished turns the
    engine keeps; the rest describes the last turn, as the engine reported it."""
    session_id: Optional[int] = None
    session_token: Optional[str] = None
    pending: Optional[str] = None  # remote: 'cancel' / 'end_session' asked before the server named the token
    turns: int = 0
    input_tokens: int = 0  # the last turn's prompt, history included
    generated_tokens: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    generating: bool = False

    @property
    def context_tokens(self) -> int:
        return self.input_tokens + self.generated_tokens if self.turns else 0


class ChatBackend:
    """Interface of local.py's and remote.py's backends (all methods are called from Gradio's worker
    threads, several tabs at once)."""

    def stream(self, session: ChatSession, message: str, settings: ChatSettings) -> Iterator[str]:
        """Run one turn and yield the answer's text increments; on return ``session`` describes the turn
        (a refused turn: ``finish_reason == 'error'``, ``error`` says why, and the conversation starts
        over, since the engine no longer holds it)."""
        raise NotImplementedError

    def stop(self, session: ChatSession):
        """Cancel the turn being generated (the partial answer stays in the conversation)."""
        raise NotImplementedError

    def reset(self, session: ChatSession):
        """Free the engine session; the next turn starts a new conversation."""
        raise NotImplementedError

    def close(self):
        pass

    @staticmethod
    def turn_messages(message: str, settings: ChatSettings, first: bool):
        """The turn's messages: a new conversation carries the system prompt, if any."""
        msgs = []
        if first and settings.system_prompt.strip():
            msgs.append({'role': 'system', 'content': settings.system_prompt})
        msgs.append({'role': 'user', 'content': message})
        return msgs
