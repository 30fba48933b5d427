"""Conversations (`format: chat` / `sharegpt`) → the model's chat template → text plus the spans to train.

A chat record is a list of `{role, content}` messages (OpenAI style; ShareGPT's `from`/`value`
are mapped onto it). It is rendered once, whole, by the model's own Jinja chat template, the
same way `tokenizer.apply_chat_template` renders it, and the rendered text is tokenized as
`apply_chat_template(messages, tokenize=True)` tokenizes it (no special tokens added, special-token
text in the rendering is matched). So the token ids are exactly the library's.

Which characters are trained comes from the template itself, never from per-model rules:
- a template with `{% generation %}` blocks marks them (transformers' `return_assistant_tokens_mask`);
- otherwise each assistant turn is found by rendering incrementally: the conversation before the
  turn with `add_generation_prompt=True`, then the conversation through the turn. The text
  between the two is the turn's content and its end-of-turn marker. Trailing whitespace after the
  marker (Qwen's and Gemma's "\\n" after `<|im_end|>`/`<end_of_turn>`) is left untrained: it is
  template glue the model never generates (it stops at the marker), and a `{% generation %}`
  template puts it outside the block too. Both renderings must be prefixes of the whole
  conversation's rendering; a template that renders earlier turns differently once later turns
  follow is reported per record.

Tokens are trained when they overlap a trained span (transformers' own rule for assistant masks).
Rendering needs transformers' Jinja environment but no tokenizer: it runs where records are parsed.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from app.data.formats import Document, Skip

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
TRAIN_ON = ("assistant", "last_assistant", "all")
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def short(value: Any, limit: int = 24) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- records → messages ------------------------------------------------------------------

def read_turns(record: Any, field: str) -> Union[list[dict], Skip]:
    """The record's `field`: a list of objects (one per turn), or why it is not."""
    if not isinstance(record, dict):
        return Skip("not an object")
    raw = record.get(field)
    if raw is None:
        return Skip(f"missing field {field!r}")
    if not isinstance(raw, list):
        return Skip(f"field {field!r} is not a list")
    if not all(isinstance(turn, dict) for turn in raw):
        return Skip("message is not an object")
    return raw


def read_messages(record: Any, field: str) -> Union[list[dict], Skip]:
    """An OpenAI-style `messages` list → validated messages (other keys, e.g. tool_calls, pass through)."""
    messages = read_message_list(record, field)
    return messages if isinstance(messages, Skip) else check_conversation(messages)


def read_message_list(record: Any, field: str) -> Union[list[dict], Skip]:
    """The record's `field` as messages with known roles and string contents, possibly empty and
    with no assistant turn (a preference pair's prompt)."""
    raw = read_turns(record, field)
    if isinstance(raw, Skip):
        return raw
    messages = []
    for message in raw:
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return Skip(f"unknown role {short(role)}")
        if not isinstance(content, str):
            return Skip("content is not a string")
        # As apply_chat_template does: a key set to null is absent (Parquet structs hold every key).
        messages.append({key: value for key, value in message.items() if value is not None})
    return messages


def read_sharegpt(record: Any, field: str, roles: dict[str, str]) -> Union[list[dict], Skip]:
    """ShareGPT `conversations` of `{from, value}` → messages, roles mapped by `roles`."""
    raw = read_turns(record, field)
    if isinstance(raw, Skip):
        return raw
    messages = []
    for turn in raw:
        speaker, value = turn.get("from"), turn.get("value")
        if not isinstance(speaker, str) or speaker not in roles:
            return Skip(f"unknown role {short(speaker)}")
        if not isinstance(value, str):
            return Skip("content is not a string")
        messages.append({"role": roles[speaker], "content": value})
    return check_conversation(messages)


def check_conversation(messages: list[dict]) -> Union[list[dict], Skip]:
    if not messages:
        return Skip("empty conversation")
    if not any(m["role"] == "assistant" for m in messages):
        return Skip("no assistant turn")
    return messages


# -- messages → text + trained spans ----------------------------------------------------------

class Rendered(NamedTuple):
    text: str
    spans: list[tuple[int, int]]  # character spans to train, in order
    turn_ends: list[int]  # where each assistant turn (and its end-of-turn marker) ends: truncation points


class ChatFormat:
    """Everything a parse task needs to turn a chat record into a Document: picklable (plain data;
    the compiled template lives in transformers' cache, per process)."""

    def __init__(self, fmt: str, template: str, special_tokens: dict, train_on: str = "assistant",
                 messages_field: str = "messages", conversations_field: str = "conversations",
                 sharegpt_roles: Optional[dict[str, str]] = None):
        if fmt not in ("chat", "sharegpt", "preference"):
            raise ValueError(f"not a chat format: {fmt!r}")
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
        self.fmt, self.template, self.special_tokens, self.train_on = fmt, template, dict(special_tokens), train_on
        self.messages_field, self.conversations_field = messages_field, conversations_field
        self.sharegpt_roles = dict(sharegpt_roles or DEFAULT_SHAREGPT_ROLES)
        self.has_generation_blocks = bool(GENERATION_BLOCK.search(template))

    def messages(self, record: Any) -> Union[list[dict], Skip]:
        if self.fmt == "chat":
            return read_messages(record, self.messages_field)
        return read_sharegpt(record, self.conversations_field, self.sharegpt_roles)

    def document(self, record: Any) -> Union[Document, Skip]:
        messages = self.messages(record)
        if isinstance(messages, Skip):
            return messages
        rendered = self.render(messages)
        if isinstance(rendered, Skip):
            return rendered
        return Document(rendered.text, None, tuple(x for span in rendered.spans for x in span),
                        tuple(rendered.turn_ends))

    def pair_document(self, record: dict, prompt_field: str, chosen_field: str,
                      rejected_field: str) -> Union[Document, Skip]:
        """A conversational preference pair → the chosen Document holding the rejected one, each
        `prompt + completion` rendered whole (the ids are apply_chat_template's), with only the
        completion's assistant turns trained."""
        prompt = read_message_list(record, prompt_field)
        if isinstance(prompt, Skip):
            return prompt
        halves = []
        for field in (chosen_field, rejected_field):
            completion = read_messages(record, field)
            if isinstance(completion, Skip):
                return Skip(f"empty {field}") if completion.reason == "empty conversation" else completion
            if not any(m["content"].strip() for m in completion if m["role"] == "assistant"):
                return Skip(f"empty {field}")
            rendered = self.render(prompt + completion)
            if isinstance(rendered, Skip):
                return rendered
            # The completion's assistant turns are the last ones rendered; earlier ones are the prompt's.
            own = sum(m["role"] == "assistant" for m in completion)
            spans = rendered.spans[-own:] if self.train_on == "assistant" else rendered.spans
            halves.append(Document(rendered.text, None, tuple(x for span in spans for x in span),
                                   tuple(rendered.turn_ends)))
        chosen, rejected = halves
        if chosen.text == rejected.text:
            return Skip("chosen equals rejected")
        return chosen._replace(rejected=rejected)

    def render_text(self, messages: list[dict], add_generation_prompt: bool = False,
                    assistant_spans: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """What apply_chat_template(tokenize=False) renders, with the `{% generation %}` spans."""
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template(
            conversations=[messages], chat_template=self.template, add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=assistant_spans, **self.special_tokens)
        return texts[0], [tuple(s) for s in (spans[0] if assistant_spans else [])]

    def render(self, messages: list[dict], incremental: Optional[bool] = None) -> Union[Rendered, Skip]:
        """The whole conversation's text and trained spans; `incremental` forces the path (tests)."""
        from jinja2 import TemplateError

        use_blocks = self.has_generation_blocks if incremental is None else not incremental
        try:
            text, turns = self.render_text(messages, assistant_spans=use_blocks)
            if not use_blocks:
                turns = self.incremental_turns(messages, text)
                if isinstance(turns, Skip):
                    return turns
        except TemplateError as err:
            return Skip(f"chat template error: {str(err)[:80]}")
        except Exception as err:  # a template bug (e.g. a filter on the wrong type) is the record's problem too
            return Skip(f"chat template error: {type(err).__name__}: {str(err)[:60]}")
        if not turns:
            return Skip("chat template rendered no assistant turn")
        if self.train_on == "all":
            spans = [(0, len(text))]
        elif self.train_on == "last_assistant":
            spans = [turns[-1]]
        else:
            spans = list(turns)
        return Rendered(text, spans, [end for _, end in turns])

    def incremental_turns(self, messages: list[dict], text: str) -> Union[list[tuple[int, int]], Skip]:
        turns = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, _ = self.render_text(messages[:i], add_generation_prompt=True)
            through, _ = self.render_text(messages[:i + 1])
            if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
                return Skip("chat template does not render turn by turn")
            end = len(through.rstrip())
            turns.append((len(before), max(end, len(before))))
        return turns


# -- text + spans → ids + labels ----------------------------------------------------------

def span_token_mask(offsets: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Tokens (as [n, 2] character offsets) that overlap any of the [k, 2] spans."""
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return mask


def tokens_before(offsets: np.ndarray, char_pos: int) -> int:
    """How many tokens start before `char_pos` (a turn end is always a token boundary: the end-of-turn
    marker is a special token, or the text after it is whitespace left untrained)."""
    return int(np.searchsorted(offsets[:, 0], char_pos, side="left"))
