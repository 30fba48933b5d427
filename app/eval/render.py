"""Eval prompts → token ids, rendered exactly as training rendered its examples.

- `messages`: the chat template with `add_generation_prompt=True`, through the same ChatFormat code
  prepare uses (app/data/chat.py), tokenized as `apply_chat_template(tokenize=True)` tokenizes.
- `prompt` for a run trained on conversations (chat, sharegpt, or preference pairs with a
  template): one user turn, the way prepare renders a standard preference pair's prompt.
- `prompt` otherwise (instruction or text): `[bos] + prompt tokens`, what training put before the
  response it learned to write (app/data/packing.py).
The template is the one that travels with the export (prepare.chat_template, else the tokenizer's
own), so eval, export and serving never disagree on the format.

Generation stops at the model's EOS and at the template's end-of-turn token (the token right after
an assistant reply in the rendering, e.g. `<|im_end|>` or `<|eot_id|>`).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from app.data.chat import ChatFormat
from app.data.packing import encode_texts
from app.eval.sets import EvalRecord

log = logging.getLogger("eft.eval")

CHAT_FORMATS = ("chat", "sharegpt", "preference", "prompts")
PROBE = "\x1fEFT_REPLY\x1f"


class EvalRenderError(ValueError):
    """A record cannot be rendered in the training format; one line naming it."""


class PromptRenderer:
    """Holds the tokenizer and template; `ids(record)` gives a record's prompt ids."""

    def __init__(self, tokenizer, template: Optional[str], training_format: str):
        self.tokenizer = tokenizer
        self.training_format = training_format
        self.chat = ChatFormat("chat", template, tokenizer.special_tokens_map) if template else None
        # A run trained on conversations answers a plain prompt as a user turn.
        self.prompt_as_turn = self.chat is not None and training_format in CHAT_FORMATS
        self.stop_ids = self.find_stop_ids()

    @property
    def mode(self) -> str:
        return "chat template" if self.prompt_as_turn else "instruction prompt"

    def text(self, record: EvalRecord) -> Optional[str]:
        """The rendered chat text of a record (None for a plain prompt tokenized as training did)."""
        if record.messages is not None:
            if self.chat is None:
                raise EvalRenderError(f"{record.where}: a messages record, but the model has no chat template "
                                      f"(set prepare.chat_template, or use prompt records)")
            return self.chat.render_text(record.messages, add_generation_prompt=True)[0]
        if self.prompt_as_turn:
            return self.chat.render_text([{"role": "user", "content": record.prompt}], add_generation_prompt=True)[0]
        return None

    def ids(self, record: EvalRecord) -> list[int]:
        text = self.text(record)
        if text is not None:
            # As apply_chat_template tokenizes its rendering: no special tokens added, the template's
            # special-token text matched as special tokens.
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + list(encode_texts(self.tokenizer, [record.prompt])[0])

    def choice_ids(self, record: EvalRecord) -> list[list[int]]:
        """Each choice's continuation tokens, as training tokenized a response after its prompt."""
        return [list(ids) for ids in encode_texts(self.tokenizer, record.choices)]

    def find_stop_ids(self) -> list[int]:
        """EOS, plus the template's end-of-turn token when it is a special token of its own."""
        stops = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        if self.chat is not None:
            try:
                text = self.chat.render_text([{"role": "user", "content": "ping"},
                                              {"role": "assistant", "content": PROBE}])[0]
            except Exception as err:  # noqa: BLE001: a template that refuses the probe has no marker to find
                # Generation then stops only at EOS or eval.max_new_tokens: say so, or a run of
                # over-long answers has no visible cause.
                log.warning("eval: the chat template refuses a probe conversation (%s: %s); generation stops "
                            "at EOS only, not at an end-of-turn token", type(err).__name__, str(err)[:120])
                text = ""
            if PROBE in text:
                after = text.split(PROBE, 1)[1]
                ids = self.tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
                special = set(self.tokenizer.all_special_ids) | {
                    i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
                if ids and ids[0] in special and ids[0] not in stops:
                    stops.append(ids[0])
        return stops


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) of prompts left-padded to the longest, as batched generation needs."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask
