"""A tiny, real base model for the demo and the tests, built here because no hub is reachable.

A BPE tokenizer trained on a real English corpus that ships with Python (the pydoc topics)
and a random-init Llama, both saved in Hugging Face format and loaded back through the same
`from_pretrained` code that real models use.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional

SPECIAL = {"bos": "<s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"}


def build_corpus(max_docs: Optional[int] = None, min_chars: int = 200) -> list[str]:
    """Real English prose: the help topics of Python's own documentation, split into paragraphs."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if len(text) >= min_chars:
                docs.append(text)
    return docs[:max_docs] if max_docs else docs


def write_jsonl(records: Iterable[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return path


def build_tiny_tokenizer(texts: list[str], vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"],
        pad_token=SPECIAL["pad"], unk_token=SPECIAL["unk"],
    )


def build_tiny_model(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     intermediate_size: int = 128, max_positions: int = 512, seed: int = 0,
                     initializer_range: float = 0.2):
    """Random init. The init is wider than the usual 0.02: behind a final RMSNorm a frozen
    random head that narrow cannot express a sharp distribution, and adapters on top of it
    would barely move the loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, initializer_range=initializer_range,
    )
    return LlamaForCausalLM(config)


def save_tiny_base(store, uri: str, texts: Optional[list[str]] = None, vocab_size: int = 512,
                   **model_kwargs) -> str:
    """Build tokenizer + model and save both, in HF format, to `uri` (s3:// or local)."""
    texts = texts or build_corpus()
    tokenizer = build_tiny_tokenizer(texts, vocab_size=vocab_size)
    model = build_tiny_model(tokenizer, **model_kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # config.json last: a reader that finds it finds a complete model dir.
        store.upload_dir(tmp, uri, last=("config.json",))
    return uri


# -- chat: a ChatML template on the tiny tokenizer, and conversations from the same docs ----------

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
END_OF_TURN = "<|im_end|>"
# ChatML (Qwen's layout, without its default system prompt). The `{% generation %}` block marks what
# is trained: the reply and its end-of-turn token, not the "\n" glue after it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_SYSTEM = "You answer questions about Python from its reference documentation."


def add_chat_template(tokenizer):
    """ChatML's two markers as special tokens (new ids after the BPE vocab) and its template."""
    tokenizer.add_tokens(list(CHAT_TOKENS), special_tokens=True)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def topic_sections(max_chars: int = 320) -> list[tuple[str, list[str]]]:
    """Each pydoc help topic as (its title, its prose paragraphs), code blocks and rules left out;
    a paragraph is cut at a sentence end to stay under `max_chars`."""
    from pydoc_data.topics import topics

    sections = []
    for key in sorted(topics):
        blocks = [b for b in topics[key].split("\n\n") if b.strip()]
        title = blocks[0].strip().splitlines()[0].strip() if blocks else ""
        prose = []
        for block in blocks[1:]:
            if block.startswith(" ") or set(block.strip()) <= set("*=-"):
                continue  # code, grammar, a heading's underline
            text = " ".join(block.split())
            if text.endswith(":"):
                text = text[:-1] + "."  # it introduced a code block, left out
            if len(text) < 60 or text.startswith("(") or not text.endswith((".", '."', ".)")):
                continue  # an aside or a sentence cut by a code block
            if len(text) > max_chars:
                cut = text.rfind(". ", 0, max_chars)
                text = text[:cut + 1] if cut > 40 else text[:max_chars].rsplit(" ", 1)[0] + " ..."
            prose.append(text)
        if title and prose and len(title) < 60:
            sections.append((title, prose))
    return sections


def build_chat_corpus(seed: int = 0) -> list[dict]:
    """OpenAI-style conversations about Python, answered from its own help topics: "What is <title>?"
    → the topic's first paragraph, "Explain <title>." → the next; a third of them with a system
    message, and a follow-up turn ("Tell me more.") where the topic has more to say."""
    import random

    rng = random.Random(seed)
    records = []
    for title, paras in topic_sections():
        subject = title[0].lower() + title[1:]
        verb = "are" if subject.endswith("s") and not subject.endswith(("ss", '"')) else "is"
        asks = [(f"What {verb} {subject}?", 0)] + ([(f"Explain {subject}.", 1)] if len(paras) > 1 else [])
        for question, i in asks:
            messages = [{"role": "system", "content": CHAT_SYSTEM}] if rng.random() < 1 / 3 else []
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": paras[i]}]
            if i + 1 < len(paras) and rng.random() < 0.5:
                messages += [{"role": "user", "content": "Tell me more."},
                             {"role": "assistant", "content": paras[i + 1]}]
            records.append({"messages": messages})
    return records


def build_preference_corpus(seed: int = 0, conversational: bool = True, max_chars: int = 160,
                            per_topic: int = 1) -> list[dict]:
    """Preference pairs about Python from its own help topics: "What is <title>?" → chosen, the
    topic's first paragraph ("Explain <title>." its second, "Tell me more about <title>." the next
    ones, up to `per_topic` paragraphs); rejected, a plausible wrong answer: another topic's
    paragraph (two thirds of the pairs) or the right one cut off mid-sentence. TRL's
    conversational form (lists of messages) by default, else its standard form (three strings)."""
    import random

    rng = random.Random(seed)
    sections = topic_sections(max_chars=max_chars)
    records = []
    for index, (title, paras) in enumerate(sections):
        subject = title[0].lower() + title[1:]
        verb = "are" if subject.endswith("s") and not subject.endswith(("ss", '"')) else "is"
        questions = [f"What {verb} {subject}?", f"Explain {subject}."]
        for i, chosen in enumerate(paras[:per_topic]):
            question = questions[i] if i < len(questions) else f"Tell me more about {subject}."
            words = chosen.split()
            if rng.random() < 2 / 3 or len(words) < 8:
                others = sections[(index + rng.randrange(1, len(sections))) % len(sections)][1]
                other = others[min(i, len(others) - 1)]
                rejected = other if other != chosen else " ".join(words[:len(words) // 2])
            else:
                rejected = " ".join(words[:rng.randrange(3, len(words) // 2 + 1)])
            if conversational:
                records.append({"prompt": [{"role": "user", "content": question}],
                                "chosen": [{"role": "assistant", "content": chosen}],
                                "rejected": [{"role": "assistant", "content": rejected}]})
            else:
                records.append({"prompt": question, "chosen": chosen, "rejected": rejected})
    return records


# -- pre-training: a base that writes words, for the demo's chat fine-tune ----------------------

# A fixed budget, so the result is the same on every machine and can be cached by its inputs:
# ~0.8M parameters, 300 steps of 16 x 128 tokens (~5 passes over the 130k-token corpus), one thread.
PRETRAIN = dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=256, vocab_size=512,
                steps=300, batch_size=16, seq_len=128, lr=3e-3, seed=0, held_out_blocks=32)
PRETRAIN_VERSION = 2  # bump when the recipe below changes: it is part of the cache key
PRETRAIN_REPORT = "pretrain.json"
# The default recipe's result, pre-trained once and shipped as package data (`make tiny-base` rebuilds
# it), so that a fresh clone's demo, local stack and tests do not spend a minute of CPU on it.
SHIPPED_BASE = Path(__file__).with_name("tiny_chat_base")


def pack_blocks(tokenizer, texts: list[str], seq_len: int):
    """The corpus as one stream (documents joined by EOS), cut into [n, seq_len] blocks."""
    import torch

    ids = []
    for doc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += doc + [tokenizer.eos_token_id]
    n = len(ids) // seq_len
    return torch.tensor(ids[:n * seq_len]).view(n, seq_len)


def pretrain(model, tokenizer, texts: list[str], steps: int, batch_size: int, seq_len: int, lr: float,
             seed: int = 0, held_out_blocks: int = 32, log=None) -> dict:
    """Plain full pre-training on CPU, one process: AdamW, one-cycle LR, random blocks of the packed
    corpus; `held_out_blocks` blocks are never trained on and measure the loss before and after."""
    import math
    import time

    import torch

    threads = torch.get_num_threads()
    # One thread: on a small shared machine the intra-op pool's spinning costs more than it wins.
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(seed)
        blocks = pack_blocks(tokenizer, texts, seq_len)
        order = torch.randperm(len(blocks), generator=gen)
        held_out, train = blocks[order[:held_out_blocks]], blocks[order[held_out_blocks:]]

        def held_out_loss() -> float:
            model.eval()
            with torch.no_grad():
                loss = sum(model(input_ids=b, labels=b).loss.item() for b in held_out.split(batch_size))
            model.train()
            return loss / math.ceil(len(held_out) / batch_size)

        before = held_out_loss()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
        start, model_loss = time.monotonic(), float("nan")
        model.train()
        for step in range(1, steps + 1):
            batch = train[torch.randint(len(train), (batch_size,), generator=gen)]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            model_loss = loss.item()
            if log and (step % 50 == 0 or step == steps):
                log(f"pre-train step {step}/{steps}: loss {model_loss:.3f} ({time.monotonic() - start:.0f} s)")
        seconds = time.monotonic() - start
        after = held_out_loss()
        model.eval()
        return {"steps": steps, "tokens": steps * batch_size * seq_len, "seconds": round(seconds, 1),
                "train_loss": round(model_loss, 4), "held_out_loss_before": round(before, 4),
                "held_out_loss_after": round(after, 4), "uniform_loss": round(math.log(len(tokenizer)), 4),
                "held_out_tokens": int(held_out.numel())}
    finally:
        torch.set_num_threads(threads)


def init_chat_tokens(model, tokenizer, seed: int = 0, noise: float = 0.02) -> None:
    """The ChatML markers never occur in the pre-training text, so their rows are untrained. Start
    them, as is usual when tokens are added to a trained model, from the closest trained tokens:
    `<|im_start|>` from BOS, `<|im_end|>` from EOS (embedding and output rows), plus a little noise
    so that the fine-tune's adapters can tell the end of a turn from the end of a document."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pairs = [(tokenizer.convert_tokens_to_ids(CHAT_TOKENS[0]), tokenizer.bos_token_id),
             (tokenizer.convert_tokens_to_ids(END_OF_TURN), tokenizer.eos_token_id)]
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            for new, like in pairs:
                weight[new] = weight[like] + noise * torch.randn(weight.shape[1], generator=gen)


def pretrain_key(texts: list[str], recipe: dict) -> str:
    import hashlib

    digest = hashlib.sha256(json.dumps({"v": PRETRAIN_VERSION, "recipe": recipe, "chat": CHATML_TEMPLATE,
                                        "texts": texts}, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def build_pretrained_base(out_dir: Path, texts: list[str], recipe: Optional[dict] = None, log=None) -> dict:
    """Tokenizer (with the ChatML template) + pre-trained Llama, saved in HF format into `out_dir`,
    with the pre-train's numbers in pretrain.json. Returns that report."""
    recipe = {**PRETRAIN, **(recipe or {})}
    tokenizer = add_chat_template(build_tiny_tokenizer(texts, vocab_size=recipe["vocab_size"]))
    model = build_tiny_model(tokenizer, hidden_size=recipe["hidden_size"], num_layers=recipe["num_layers"],
                             num_heads=recipe["num_heads"], intermediate_size=recipe["intermediate_size"],
                             max_positions=max(512, recipe["seq_len"]), seed=recipe["seed"],
                             initializer_range=0.02)
    # Generation stops at either end marker: EOS (documents) or the end of an assistant turn.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    report = pretrain(model, tokenizer, texts, steps=recipe["steps"], batch_size=recipe["batch_size"],
                      seq_len=recipe["seq_len"], lr=recipe["lr"], seed=recipe["seed"],
                      held_out_blocks=recipe["held_out_blocks"], log=log)
    init_chat_tokens(model, tokenizer, seed=recipe["seed"])
    report["key"] = pretrain_key(texts, recipe)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (Path(out_dir) / PRETRAIN_REPORT).write_text(json.dumps(report, indent=2))
    return report


def save_pretrained_base(store, uri: str, texts: Optional[list[str]] = None, cache_dir: Optional[Path] = None,
                         recipe: Optional[dict] = None, log=None) -> dict:
    """The pre-trained chat base at `uri`, built once: a model dir at `uri` whose pretrain.json has this
    recipe's key is kept; else the shipped base (`SHIPPED_BASE`) is uploaded when its key is this one;
    else a copy in `cache_dir` (keyed by corpus + recipe) is uploaded; else it is pre-trained (into the
    cache when there is one). config.json goes up last: a reader that finds it finds a complete model
    dir. Returns the report with `source`: "bucket", "shipped", "disk cache" or "trained"."""
    import shutil

    texts = texts or build_corpus()
    key = pretrain_key(texts, {**PRETRAIN, **(recipe or {})})
    report_uri = uri.rstrip("/") + "/" + PRETRAIN_REPORT
    if store.exists(uri.rstrip("/") + "/config.json") and store.exists(report_uri):
        report = store.read_json(report_uri)
        if report.get("key") == key:
            return {**report, "source": "bucket"}
    shipped = read_shipped_report()
    # Keyed like the cache: another recipe, or a Python whose pydoc topics differ, gets its own base.
    if shipped is not None and shipped.get("key") == key:
        store.upload_dir(SHIPPED_BASE, uri, last=("config.json",))
        return {**shipped, "source": "shipped"}
    cached = Path(cache_dir) / f"tiny-chat-base-{key}" if cache_dir else None
    if cached is not None and (cached / "config.json").exists():
        report = {**json.loads((cached / PRETRAIN_REPORT).read_text()), "source": "disk cache"}
    else:
        if cached is not None:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # on the cache's disk: the rename is atomic
            report = {**build_pretrained_base(Path(tmp) / "model", texts, recipe, log=log), "source": "trained"}
            if cached is None:
                store.upload_dir(Path(tmp) / "model", uri, last=("config.json",))
                return report
            shutil.rmtree(cached, ignore_errors=True)
            os.rename(Path(tmp) / "model", cached)  # whole or not at all
    store.upload_dir(cached, uri, last=("config.json",))
    return report


def read_shipped_report() -> Optional[dict]:
    """The shipped base's pretrain.json, or None where the package carries no complete base."""
    if not (SHIPPED_BASE / "config.json").is_file() or not (SHIPPED_BASE / PRETRAIN_REPORT).is_file():
        return None
    return json.loads((SHIPPED_BASE / PRETRAIN_REPORT).read_text())


def rebuild_shipped_base(out_dir: Path = SHIPPED_BASE, log=print) -> dict:
    """Pre-train the default recipe on this Python's pydoc topics into `out_dir` (`make tiny-base`).
    Built in a temp dir beside it and renamed into place, so an interrupted rebuild leaves the old base
    whole; the README beside the weights is carried over. Returns the pre-train's report."""
    import shutil

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would follow the rename into the package
    old = out_dir.with_name(tmp.name + "-old")
    try:
        report = build_pretrained_base(tmp, build_corpus(), log=log)
        for path in tmp.iterdir():
            path.chmod(0o644)  # the weights are written 0600 (through a temp file): shipped files are read by all
        if (out_dir / "README.md").is_file():
            shutil.copy2(out_dir / "README.md", tmp / "README.md")
        if out_dir.exists():
            os.rename(out_dir, old)  # a directory cannot be renamed over a non-empty one
        os.rename(tmp, out_dir)  # the commit: from here on the new base is the shipped one
    finally:
        if old.exists() and not out_dir.exists():
            os.rename(old, out_dir)  # the new one never got in: keep the old
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    log(f"shipped base rebuilt in {out_dir}: key {report['key']}, held-out loss "
        f"{report['held_out_loss_before']:.2f} -> {report['held_out_loss_after']:.2f} in {report['seconds']:.0f} s")
    return report


if __name__ == "__main__":  # `python -m app.dev.tiny`, i.e. `make tiny-base`
    rebuild_shipped_base()
