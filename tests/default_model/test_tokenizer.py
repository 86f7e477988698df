"""The default model's byte tokenizer (kvlib.default_model.tokenizer)."""

from hypothesis import given
from hypothesis import strategies as st

from kvlib.default_model import ByteTokenizer
from kvlib.default_model.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


@given(st.text())
def test_round_trip_is_lossless(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and tokenizer.decode(ids) == text
    assert tokenizer.encode(text, bos=True) == [BOS_ID] + ids


def test_specials_are_skipped_and_bad_utf8_replaced():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([BOS_ID, 104, 105, EOS_ID, PAD_ID]) == "hi"
    assert tokenizer.decode([0xFF, 104]) == "\ufffdh"
    assert VOCAB_SIZE == 259 and (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (256, 257, 258)
