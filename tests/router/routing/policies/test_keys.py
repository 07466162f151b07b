from __future__ import annotations

from dpserve.router.routing.policies.keys import prompt_prefix, session_id


def test_the_session_header_wins_over_the_user_field():
    headers = [(b"content-type", b"application/json"), (b"x-session-id", b" conv-42 ")]
    assert session_id(headers, {"user": "alice"}) == "conv-42"


def test_the_openai_user_field_is_the_session_without_a_header():
    assert session_id([], {"user": "alice"}) == "alice"


def test_blank_or_non_string_keys_are_no_session():
    assert session_id([(b"x-session-id", b"  ")], {"user": 7}) is None
    assert session_id([], {"user": ""}) is None
    assert session_id([], None) is None


def test_long_session_ids_are_cut():
    assert len(session_id([(b"x-session-id", b"x" * 10_000)], None)) == 256


def test_a_completion_prompt_is_cut_to_the_prefix_length():
    assert prompt_prefix({"prompt": "Once upon a time"}, 9) == "Once upon"


def test_a_batch_is_keyed_by_its_first_prompt():
    assert prompt_prefix({"prompt": ["first one", "second"]}, 5) == "first"


def test_token_id_prompts_become_their_ids():
    assert prompt_prefix({"prompt": [101, 7, 2048]}, 100) == "101,7,2048"
    assert prompt_prefix({"prompt": [[5, 6], [7]]}, 100) == "5,6"


def test_chat_messages_are_rendered_role_by_role():
    payload = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "},
                                     {"type": "image_url", "image_url": {"url": "data:..."}},
                                     {"type": "text", "text": "this?"}]},
    ]}
    assert prompt_prefix(payload, 1000) == "system: Be brief.\nuser: What is <image_url>this?\n"
    assert prompt_prefix(payload, 12) == "system: Be b"


def test_embeddings_input_counts_as_a_prompt():
    assert prompt_prefix({"input": "embed me"}, 5) == "embed"


def test_bodies_without_a_prompt_have_no_prefix():
    assert prompt_prefix({"model": "m"}, 10) is None
    assert prompt_prefix({"prompt": ""}, 10) is None
    assert prompt_prefix({"messages": "not a list", "prompt": None}, 10) is None
    assert prompt_prefix(None, 10) is None
