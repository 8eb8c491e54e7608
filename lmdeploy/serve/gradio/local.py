"""The chat page's backend for a model in this process: the engine behind a
:class:`~lmdeploy.frontend.pipeline.Pipeline`, one interactive session per browser tab."""
from __future__ import annotations

from typing import Iterator, Optional

from lmdeploy.frontend.pipeline import Pipeline, Session
from lmdeploy.messages import GenerationConfig

from .backend import ChatBackend, ChatSession, ChatSettings


class LocalBackend(ChatBackend):

    def __init__(self, pipeline: Pipeline, owns_pipeline: bool = False):
        self.pipeline = pipeline
        self._owns = owns_pipeline

    @classmethod
    def from_model(cls, model_path: str, backend_config=None, chat_template_config=None) -> 'LocalBackend':
        return cls(Pipeline(model_path, backend_config, chat_template_config), owns_pipeline=True)

    @property
    def engine(self):
        return self.pipeline.engine

    def stream(self, session: ChatSession, message: str, settings: ChatSettings) -> Iterator[str]:
        settings.check()
        if session.generating:
            raise ValueError('this conversation is already generating an answer')
        if session.session_id is None:
            session.session_id = self.pipeline.gateway.next_session_id()
        gen = GenerationConfig(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                               top_p=settings.top_p, do_sample=settings.temperature > 0)
        first = session.turns == 0
        turn = Session(session.session_id, step=session.turns)  # the pipeline's view of the same session
        session.generating, session.error, finished = True, None, False
        reason: Optional[str] = None
        try:
            for piece in self.pipeline.chat(self.turn_messages(message, settings, first), turn, gen,
                                            stream_response=True):
                session.input_tokens = piece.input_token_len
                session.generated_tokens = piece.generate_token_len
                if piece.error:
                    session.error = piece.error
                if piece.finish_reason:
                    reason = piece.finish_reason
                if piece.text:
                    yield piece.text
            finished = True
        finally:
            session.generating = False
            if not finished:  # the page went away mid-turn: stop the engine, keep nothing half-known
                self.pipeline.gateway.cancel(session.session_id)
                reason = reason or 'abort'
            session.finish_reason = reason
            if reason == 'error' or session.error:  # refused (e.g. too long): the engine kept nothing, start over
                self._forget(session)
            else:
                session.turns += 1

    def stop(self, session: ChatSession):
        if session.session_id is not None:
            self.pipeline.gateway.cancel(session.session_id)

    def reset(self, session: ChatSession):
        if session.session_id is not None:
            self.pipeline.end_session(session.session_id)
        self._forget(session)

    @staticmethod
    def _forget(session: ChatSession):
        session.session_id, session.turns = None, 0

    def close(self):
        if self._owns:
            self.pipeline.close()
