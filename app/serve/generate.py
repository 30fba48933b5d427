"""Generation for `eft serve`'s transformers engine: one model per replica, `generate` streaming
its tokens into text pieces.

Prompts go through eval's PromptRenderer (app/eval/render.py), so a chat request is rendered by
the same ChatFormat code prepare trained on, with the export's template, and tokenized as
`apply_chat_template` tokenizes; a completion prompt is what training put before a text document,
`[bos] + its tokens`. Generation stops at the renderer's stop ids (EOS and the template's
end-of-turn token), at a stop sequence, or after `max_tokens`.

Streamed and whole answers are one code path: a whole answer is its pieces joined. A piece never
holds text that could still turn out to start a stop sequence, nor half of a UTF-8 character, so
the concatenated pieces are exactly the final text, which is the decoded tokens cut before the
first stop sequence (and before the stop token, which is not text).

One `generate` runs at a time per replica, on one worker thread of its own: on CPU, two at once in
one process share its cores and the GIL and finish no sooner; throughput comes from replicas, which
are processes. A whole answer without stop sequences is decoded once, at the end; a stream, or a
request with stop sequences, is decoded as it grows (that is what finds a stop sequence).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Iterator, NamedTuple, Optional

from app.eval.render import EvalRenderError, PromptRenderer
from app.eval.sets import EvalRecord
from app.serve.openai_api import RequestError
from app.serve.source import ServedModel
from app.storage import Store

# Under Serve's own logger: a replica writes what it logs to Serve's replica log files (with the
# replica's id); a logger of another name would have no handler there.
log = logging.getLogger("ray.serve.eft")
# Prompts are rendered as eval renders them; "text" keeps a completion's prompt raw text (OpenAI's
# /v1/completions), where a chat-trained run would have made it a user turn.
RAW_PROMPTS = "text"
REPLACEMENT_CHAR = "\ufffd"  # what decoding shows for a character whose bytes are not all generated yet


class Sampling(NamedTuple):
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: Optional[int]


class Piece(NamedTuple):
    text: str  # new text, to append to what came before
    finish_reason: Optional[str]  # on the last piece only: "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


class TextGenerator:
    """A replica's model, tokenizer and renderer, loaded once."""

    def __init__(self, served: ServedModel, max_tokens_limit: int):
        import torch
        from transformers import AutoTokenizer

        from app.eval.engine import load_eval_model

        store = Store(served.endpoint, served.region)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.threads = torch.get_num_threads()  # Ray sets OMP_NUM_THREADS to the replica's CPUs
        self.model = load_eval_model(store, served.engine_source(), self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(store.cache_locally(served.tokenizer_uri)))
        template = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else None
        self.renderer = PromptRenderer(self.tokenizer, template, RAW_PROMPTS)
        self.stop_ids = list(self.renderer.stop_ids)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_tokens_limit = max_tokens_limit
        # One thread for every generate: requests queue for it (a thread per request cost ~3 ms to start).
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eft-serve-generate")

    # -- rendering -------------------------------------------------------------------------

    def chat_ids(self, messages: list[dict]) -> list[int]:
        try:
            return self.renderer.ids(EvalRecord(index=0, where="messages", kind="generation", messages=messages))
        except EvalRenderError as err:
            raise RequestError(str(err), param="messages") from None
        except Exception as err:  # noqa: BLE001: the template rejected these messages (a Jinja error)
            raise RequestError(f"messages: the chat template cannot render them ({type(err).__name__}: "
                               f"{str(err)[:120]})", param="messages") from None

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.renderer.ids(EvalRecord(index=0, where="prompt", kind="generation", prompt=prompt))

    def check_budget(self, ids: list[int], sampling: Sampling) -> Sampling:
        """The request's max_tokens within the server's limit, cut to what the context leaves."""
        if sampling.max_tokens > self.max_tokens_limit:
            raise RequestError(f"max_tokens {sampling.max_tokens} is over this server's limit of "
                               f"{self.max_tokens_limit} (eft serve --max-tokens)", param="max_tokens")
        if self.context is not None and len(ids) >= self.context:
            raise RequestError(f"the prompt is {len(ids)} tokens; the model's context is {self.context}",
                               param="messages")
        room = self.context - len(ids) if self.context is not None else sampling.max_tokens
        return sampling._replace(max_tokens=min(sampling.max_tokens, room))

    # -- generation ------------------------------------------------------------------------

    def start(self, ids: list[int], sampling: Sampling, emit: Callable[[object], None],
              incremental: bool = True) -> threading.Event:
        """Queue a generation for the worker thread; `emit` gets each Piece (the last with its finish
        reason) or the exception that ended it. Returns the event that cancels it."""
        cancelled = threading.Event()
        self.worker.submit(self.run, ids, sampling, emit, cancelled, incremental or bool(sampling.stop))
        return cancelled

    def run(self, ids: list[int], sampling: Sampling, emit: Callable[[object], None],
            cancelled: threading.Event, incremental: bool) -> None:
        import torch
        from transformers import StoppingCriteriaList

        if cancelled.is_set():  # the request went away while it queued
            return
        streamer = PieceStreamer(self.tokenizer, self.stop_ids, sampling.stop, len(ids), emit, incremental)
        try:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)  # the one worker thread: no other request draws from the RNG
            with torch.no_grad():
                self.model.generate(
                    input_ids=torch.tensor([ids], device=self.device),
                    attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=self.device),
                    max_new_tokens=sampling.max_tokens, streamer=streamer,
                    stopping_criteria=StoppingCriteriaList([FlagCriteria(streamer, cancelled)]),
                    eos_token_id=self.stop_ids, pad_token_id=self.pad_id, **decoding_kwargs(sampling))
            streamer.finish()
        except Exception as err:  # noqa: BLE001: handed to the request, which answers 500
            log.exception("generation failed")
            emit(err)


def decoding_kwargs(sampling: Sampling) -> dict:
    """Greedy at temperature 0 (OpenAI's deterministic setting); else sampling at the request's
    temperature and nucleus, with transformers' own top-k (50 by default) turned off, since the
    OpenAI API has no top-k."""
    if sampling.temperature == 0:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": sampling.temperature,
            "top_p": sampling.top_p if sampling.top_p < 1 else None, "top_k": None}


class FlagCriteria:
    """Stops `generate` once the streamer found a stop sequence, or the request went away."""

    def __init__(self, streamer: "PieceStreamer", cancelled: threading.Event):
        self.streamer, self.cancelled = streamer, cancelled

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        stop = self.cancelled.is_set() or self.streamer.finish_reason is not None
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class PieceStreamer:
    """A `generate` streamer: new tokens → text pieces, held back while they could still be the
    start of a stop sequence."""

    def __init__(self, tokenizer, stop_ids: list[int], stops: tuple[str, ...], prompt_tokens: int,
                 emit: Callable[[object], None], incremental: bool = True):
        self.tokenizer, self.stop_ids, self.stops, self.emit = tokenizer, set(stop_ids), stops, emit
        self.incremental = incremental  # decode as the text grows (streams, stop sequences), or once at the end
        self.prompt_tokens = prompt_tokens
        self.tokens: list[int] = []
        self.generated = 0  # every token generated, the stop token included (OpenAI's usage count)
        self.sent = ""
        self.cut_text: Optional[str] = None  # the final text, when a stop sequence cut it
        self.finish_reason: Optional[str] = None
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate hands the streamer the prompt first
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            if self.finish_reason is not None:
                return
            self.generated += 1
            if token in self.stop_ids:
                self.finish_reason = "stop"
                return
            self.tokens.append(token)
            if not self.incremental:
                continue
            text = self.decode()
            hit = first_stop(text, self.stops)
            if hit is not None:
                self.cut_text, self.finish_reason = text[:hit], "stop"
                return
            self.send(text[:len(text) - held_back(text, self.stops)])

    def end(self) -> None:
        pass

    def decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def send(self, safe: str) -> None:
        if len(safe) > len(self.sent) and safe.startswith(self.sent):
            piece, self.sent = safe[len(self.sent):], safe
            self.emit(Piece(piece, None, self.prompt_tokens, self.generated))

    def finish(self) -> None:
        """The last piece: whatever was held back, and why generation ended."""
        final = self.cut_text if self.cut_text is not None else self.decode()
        if not final.startswith(self.sent):
            # Only a tokenizer whose decoding of a longer sequence rewrites earlier text gets here.
            log.warning("decoded text changed under text already streamed; the stream ends with the new text's tail")
        self.emit(Piece(final[len(self.sent):], self.finish_reason or "length", self.prompt_tokens, self.generated))


def first_stop(text: str, stops: tuple[str, ...]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters to hold: a partial UTF-8 character, or the longest tail that a
    stop sequence starts with."""
    hold = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


# -- consuming the pieces ----------------------------------------------------------------------


def iter_pieces(generator: TextGenerator, ids: list[int], sampling: Sampling,
                incremental: bool = True) -> Iterator[Piece]:
    """The pieces of one generation, in this thread (tests, benchmarks)."""
    items: queue.Queue = queue.Queue()
    cancelled = generator.start(ids, sampling, items.put, incremental)
    try:
        while True:
            item = items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        cancelled.set()


async def aiter_pieces(generator: TextGenerator, ids: list[int], sampling: Sampling,
                       incremental: bool = True) -> AsyncIterator[Piece]:
    """The pieces of one generation, on the replica's event loop. A request that goes away (the
    client disconnected: Serve cancels its task) cancels its generation at the next token, or
    before it starts when it is still queued."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    cancelled = generator.start(ids, sampling, lambda item: loop.call_soon_threadsafe(items.put_nowait, item),
                                incremental)
    try:
        while True:
            item = await items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        cancelled.set()


def join_pieces(pieces: list[Piece]) -> tuple[str, str, int, int]:
    """(text, finish reason, prompt tokens, completion tokens) of a whole answer."""
    last = pieces[-1]
    return "".join(p.text for p in pieces), last.finish_reason, last.prompt_tokens, last.completion_tokens
