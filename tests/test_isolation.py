"""Packed rows keep their documents apart: with the packer's position_ids (and no attention mask,
no KV cache) the tiny Llama's loss and gradients on a packed row are exactly those of its documents
run one at a time. Pure torch, no Ray. The end-to-end checks through FSDP2 are in test_train.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numerics import assert_close
from one_document import build_example

from app.batch import IGNORE_INDEX
from app.data.packing import pack_examples
from app.model.loss import loss_sum

BOS, EOS, PAD = 1, 2, 0
VOCAB = 96
DOC_LENGTHS = (6, 11, 1, 9)  # bodies; + bos/eos each, one row of 40 with padding at the end
SEQ_LEN = 40


def tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, initializer_range=0.2,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).float()


def packed_row(seed: int = 0, first_doc: list[int] | None = None):
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(3, VOCAB, size=n).tolist() for n in DOC_LENGTHS]
    if first_doc is not None:
        bodies[0] = first_doc
    examples = [build_example(b, eos_id=EOS, bos_id=BOS) for b in bodies]
    ids, labels, positions = pack_examples(examples, seq_len=SEQ_LEN, pad_id=PAD)
    assert ids.shape == (1, SEQ_LEN) and labels[0, -1] == IGNORE_INDEX  # one row, padded
    lengths = [len(e[0]) for e in examples]
    return (torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(labels, dtype=torch.long),
            torch.as_tensor(positions, dtype=torch.long), lengths)


def segments(lengths: list[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(lengths).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    return bounds + [(ends[-1], SEQ_LEN)]  # the padding is a segment of its own


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(params=["sdpa", "eager"])
def model(request):
    return tiny_llama(request.param)


def test_a_packed_row_trains_exactly_like_its_documents_one_at_a_time(model):
    """Loss and gradients: the packed row through loss_sum (position_ids, no mask, no cache) equals
    the sum over its documents, each run alone from position 0, of the same next-token terms."""
    ids, labels, positions, lengths = packed_row()
    packed = loss_sum(model, ids, labels, None, positions)
    packed.backward()
    packed_grads = grads(model)

    reference = torch.zeros(())
    logits_alone = []
    next_labels = torch.cat([labels[0, 1:], torch.tensor([IGNORE_INDEX])])  # what each position predicts
    for start, end in segments(lengths):
        logits = model(input_ids=ids[:, start:end], use_cache=False).logits[0]
        logits_alone.append(logits.detach())
        reference = reference + torch.nn.functional.cross_entropy(
            logits, next_labels[start:end], ignore_index=IGNORE_INDEX, reduction="sum")
    reference.backward()
    reference_grads = grads(model)

    with torch.no_grad():
        full = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    assert_close(full, torch.cat(logits_alone), rtol=1e-5, atol=1e-5)
    assert_close(packed, reference, rtol=1e-6, atol=1e-6)
    for got, want in zip(packed_grads, reference_grads, strict=True):
        # fp32 summation-order noise only: a few 1e-6 on gradients of order 1.
        assert_close(got, want, rtol=1e-4, atol=1e-5)
    # ... and attending across documents is measurably something else.
    crossing = loss_sum(model, ids, labels, None)
    assert abs(crossing.item() - packed.item()) > 1e-2


@torch.no_grad()
def test_a_planted_change_in_one_document_reaches_the_next_only_without_isolation(model):
    """Rewrite document 1's tokens: documents 2.. (logits and loss) do not move with position_ids,
    and do without them (today's cross-document attention)."""
    ids, labels, positions, lengths = packed_row()
    other_ids, other_labels, other_positions, other_lengths = packed_row(first_doc=list(range(40, 46)))
    assert other_lengths == lengths and (other_positions == positions).all()
    after = lengths[0]  # first token of document 2
    assert (ids[0, after:] == other_ids[0, after:]).all() and (ids[0, 1:after - 1] != other_ids[0, 1:after - 1]).all()

    def rest(input_ids, label_ids, pos):
        logits = model(input_ids=input_ids, position_ids=pos, use_cache=False).logits[0, after:]
        loss = loss_sum(model, input_ids[:, after:], label_ids[:, after:], None, None if pos is None else pos[:, after:])
        return logits, loss

    isolated, isolated_other = rest(ids, labels, positions), rest(other_ids, other_labels, other_positions)
    assert_close(isolated[0], isolated_other[0], rtol=0, atol=1e-5)
    crossing, crossing_other = rest(ids, labels, None), rest(other_ids, other_labels, None)
    assert (crossing[0] - crossing_other[0]).abs().max() > 1e-2
    # The loss of documents 2.. in the packed row, isolated: unchanged by document 1.
    mask = labels.clone()
    mask[0, :after + 1] = IGNORE_INDEX  # keep only predictions made inside documents 2..
    other_mask = other_labels.clone()
    other_mask[0, :after + 1] = IGNORE_INDEX
    assert_close(loss_sum(model, ids, mask, None, positions),
                 loss_sum(model, other_ids, other_mask, None, other_positions), rtol=0, atol=1e-6)
    assert abs(float(loss_sum(model, ids, mask, None)) - float(loss_sum(model, other_ids, other_mask, None))) > 1e-3


@torch.no_grad()
def test_a_batch_mixing_packed_and_single_document_rows_keeps_each_row_right(model):
    """Detection runs on the whole batch: a row that is one (continued) document, 0..T-1, beside a
    packed row, still gets a plain causal mask, equal to running it alone."""
    ids, labels, positions, _ = packed_row()
    plain = torch.arange(3, 3 + SEQ_LEN).remainder(VOCAB)[None]
    batch_ids = torch.cat([ids, plain])
    batch_positions = torch.cat([positions, torch.arange(SEQ_LEN)[None]])
    both = model(input_ids=batch_ids, position_ids=batch_positions, use_cache=False).logits
    assert_close(both[1], model(input_ids=plain, use_cache=False).logits[0], rtol=1e-5, atol=1e-5)
    assert_close(both[0], model(input_ids=ids, position_ids=positions, use_cache=False).logits[0],
                 rtol=1e-5, atol=1e-5)


def test_isolation_is_on_by_default_off_on_request_and_off_with_a_note_for_old_datasets(caplog):
    from app.config import build_config
    from app.data.stream import document_isolation

    def cfg(**data):
        return build_config({"name": "t", "model": {"uri": "s3://b/m"}, "data": {"uri": "s3://b/d", **data},
                             "training": {"max_steps": 1}, "storage": {"root_uri": "s3://b/runs"}})

    new, old = {"position_ids": True}, {}
    assert cfg().data.cross_document_attention is False
    with caplog.at_level("WARNING", logger="app.data.stream"):
        assert document_isolation(cfg(), new) is True
        assert document_isolation(cfg(cross_document_attention=True), new) is False
        assert document_isolation(cfg(cross_document_attention=True), old) is False
        assert not caplog.records
        assert document_isolation(cfg(), old, note=False) is False
        assert not caplog.records
        assert document_isolation(cfg(), old) is False
    (record,) = caplog.records
    assert "s3://b/d was prepared without position_ids" in record.getMessage()
