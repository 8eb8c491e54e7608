"""The chat page (Gradio Blocks) over a :class:`~.backend.ChatBackend`, and :func:`run` to serve it.

Each browser tab gets its own :class:`_Tab` state (Gradio copies a State's initial value per tab), so its
own engine session; the chat event streams with no concurrency limit, so tabs chat at once; stop and
reset bypass Gradio's queue, so they act while the tab's answer is still streaming. A tab that closes
frees its engine session at once (Gradio's unload event; Gradio itself drops a closed tab's state only
an hour later).

No ``from __future__ import annotations`` here: Gradio finds the ``gr.Request`` parameter by its
annotation, which must be the class itself."""
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .backend import ChatBackend, ChatSession, ChatSettings

TITLE = 'LMDeploy chat'
UPDATE_S = 0.05  # the shortest time between two updates of a streaming answer


@dataclass
class _Tab:
    """One tab's conversation: the engine session and what the chat box shows."""
    session: ChatSession = field(default_factory=ChatSession)
    history: List[Dict[str, str]] = field(default_factory=list)


def _status(session: ChatSession) -> str:
    if session.generating:
        return 'generating...'
    if session.error:
        return f'error: {session.error}'
    if session.finish_reason is None:
        return 'ready'
    why = {'stop': 'finished', 'length': 'reached max new tokens', 'abort': 'stopped'}.get(
        session.finish_reason, session.finish_reason)
    return (f'{why}: {session.generated_tokens} new tokens; the conversation holds '
            f'{session.context_tokens} tokens')


def build_page(backend: ChatBackend, title: str = TITLE, defaults: Optional[ChatSettings] = None):
    """The ``gr.Blocks`` of the chat page (not launched)."""
    import gradio as gr
    d = defaults or ChatSettings()
    open_tabs: Dict[str, _Tab] = {}  # Gradio's session hash -> the tab's state, to free it on unload
    lock = threading.Lock()

    def chat(message: str, tab: _Tab, max_new_tokens, temperature, top_p, system_prompt, request: gr.Request):
        if request is not None and request.session_hash:
            with lock:
                open_tabs[request.session_hash] = tab
        if not message or not message.strip() or tab.session.generating:
            yield message, tab.history, _status(tab.session)
            return
        settings = ChatSettings(int(max_new_tokens), float(temperature), float(top_p), system_prompt or '')
        tab.history.append({'role': 'user', 'content': message})
        answer = {'role': 'assistant', 'content': ''}
        tab.history.append(answer)
        try:
            turn = backend.stream(tab.session, message, settings)
            yield '', tab.history, 'generating...'
            shown = time.monotonic()
            for piece in turn:
                answer['content'] += piece
                # at most UPDATE_S between updates: each one re-sends the conversation, and a page that
                # falls behind the engine would go on streaming after Stop
                if time.monotonic() - shown >= UPDATE_S:
                    shown = time.monotonic()
                    yield '', tab.history, 'generating...'
        except ValueError as e:  # a setting out of range: said on the page, nothing sent
            tab.session.error = str(e)
        if not answer['content']:
            tab.history.pop()
        yield '', tab.history, _status(tab.session)

    def stop(tab: _Tab):
        backend.stop(tab.session)

    def reset(tab: _Tab):
        backend.reset(tab.session)
        tab.history.clear()
        tab.session = ChatSession()
        return [], 'conversation reset: the engine session is freed'

    def forget(tab: Any):  # Gradio dropped the tab's state: free its engine session (if still held)
        if isinstance(tab, _Tab):
            backend.reset(tab.session)

    def closed(request: gr.Request):  # the tab closed or reloaded: free its engine session now
        with lock:
            tab = open_tabs.pop(getattr(request, 'session_hash', None), None)
        if tab is not None:
            backend.reset(tab.session)

    with gr.Blocks(title=title) as page:
        gr.Markdown(f'## {title}')
        tab = gr.State(_Tab(), delete_callback=forget)
        chatbot = gr.Chatbot(elem_id='chatbot', label='conversation', height=420)
        with gr.Row():
            message = gr.Textbox(elem_id='message', show_label=False, placeholder='Type a message, Enter sends',
                                 scale=6)
            send = gr.Button('Send', elem_id='send', variant='primary', scale=1)
            stop_btn = gr.Button('Stop', elem_id='stop', variant='stop', scale=1)
            reset_btn = gr.Button('Reset', elem_id='reset', scale=1)
        status = gr.Markdown('ready', elem_id='status')
        with gr.Accordion('Settings', open=True):
            system_prompt = gr.Textbox(d.system_prompt, label='System prompt (starts the next conversation)',
                                       elem_id='system_prompt', lines=2)
            with gr.Row():
                max_new = gr.Slider(1, 4096, value=d.max_new_tokens, step=1, label='max new tokens',
                                    elem_id='max_new_tokens')
                temperature = gr.Slider(0.0, 2.0, value=d.temperature, step=0.05, label='temperature',
                                        elem_id='temperature')
                top_p = gr.Slider(0.01, 1.0, value=d.top_p, step=0.01, label='top-p', elem_id='top_p')
        inputs = [message, tab, max_new, temperature, top_p, system_prompt]
        outputs = [message, chatbot, status]
        for trigger in (message.submit, send.click):
            trigger(chat, inputs, outputs, concurrency_limit=None, show_progress='hidden')
        stop_btn.click(stop, [tab], None, queue=False)
        reset_btn.click(reset, [tab], [chatbot, status], queue=False)
        page.unload(closed)
    return page


def run(target: Optional[str] = None, server_name: str = '0.0.0.0', server_port: int = 6006,
        backend_config=None, chat_template_config=None, api_key: Optional[str] = None,
        inbrowser: bool = False, block: bool = True):
    """Serve the chat page: ``target`` is a local model directory (None: the embedded default model) or the
    URL of a running ``api_server`` (``http://host:23333``). ``block=False`` returns ``(page, backend)``
    with the page running on a thread."""
    os.environ.setdefault('GRADIO_ANALYTICS_ENABLED', 'False')
    if target and target.startswith(('http://', 'https://')):
        from .remote import RemoteBackend
        backend: ChatBackend = RemoteBackend(target, api_key=api_key)
        models = backend.check()
        title = f'{TITLE}: {models[0] if models else target}'
    else:
        from lmdeploy.default_model import resolve_model_path

        from .local import LocalBackend
        path = resolve_model_path(target)
        backend = LocalBackend.from_model(path, backend_config, chat_template_config)
        title = f'{TITLE}: {os.path.basename(path.rstrip("/"))}'
    page = build_page(backend, title)
    page.queue()
    # quiet: Gradio's own banner tells the user to "set `share=True` in `launch()`", which a user of the
    # command line cannot do; the address is said here instead
    page.launch(server_name=server_name, server_port=server_port, share=False, inbrowser=inbrowser,
                prevent_thread_lock=True, quiet=True)
    if block:
        print(address_line(server_name, page.server_port or server_port), flush=True)
        try:
            page.block_thread()  # until Ctrl-C
        finally:
            backend.close()
    return page, backend


def address_line(server_name: str, port: int) -> str:
    """Where the page is, said once it listens (a wildcard address is opened as 127.0.0.1 here)."""
    wildcard = server_name in ('', '0.0.0.0', '::')
    host = '127.0.0.1' if wildcard else (f'[{server_name}]' if ':' in server_name else server_name)
    where = " (listening on all addresses: other machines use this one's address)" if wildcard else ''
    return f'lmdeploy serve gradio: the chat page is at http://{host}:{port}{where}; Ctrl-C stops it'
