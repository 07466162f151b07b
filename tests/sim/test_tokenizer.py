"""The pseudo-tokenizer counts 1-4 character pieces and round-trips its own text."""

from __future__ import annotations

from dpserve.sim import SimTokenizer, tokenizer


def test_a_token_is_up_to_four_non_space_characters():
    assert tokenizer.count("a tokenizer") == 4  # a | toke nize r
    assert tokenizer.count("  \n\t ") == 0
    assert len(tokenizer.encode("x" * 4000)) == 1000


def test_ids_are_deterministic_and_in_the_vocabulary():
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, 42 times!")
    assert ids == tokenizer.encode("The  quick\nbrown fox jumps over the lazy dog, 42 times!")
    assert all(0 <= t < tokenizer.VOCAB_SIZE for t in ids)


def test_decoding_then_encoding_gives_back_the_ids():
    ids = [0, 1, 4095, 64, 1234, 7]
    assert tokenizer.encode(tokenizer.decode(ids)) == ids


def test_the_tokenizer_object_speaks_the_hugging_face_subset():
    tok = SimTokenizer()
    assert tok.num_special_tokens_to_add() == 0 and tok.all_special_ids == []
    assert tok("one two three").input_ids == tok.encode("one two three", add_special_tokens=False)
    assert tok.encode(tok.decode([5, 6, 7])) == [5, 6, 7]
