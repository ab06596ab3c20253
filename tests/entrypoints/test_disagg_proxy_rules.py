"""Which requests `tokenmill disagg-proxy` splits into a prefill and a decode, and the prefill instance's copy."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.entrypoints.router.disagg import DisaggConfig, build_disagg_app, prefill_body, splittable

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize("path, body, split", [
    (CMPL, {"prompt": "hello"}, True),
    (CMPL, {"prompt": [1, 2, 3]}, True),
    (CMPL, {"prompt": ["one"]}, True),
    (CMPL, {"prompt": ["one", "two"]}, False),  # several prompts
    (CMPL, {"prompt": "hello", "n": 2}, False),
    (CMPL, {"prompt": "hello", "echo": True}, False),
    (CMPL, {"prompt": "hello", "prompt_logprobs": 1}, False),
    (CMPL, {"prompt": "hello", "use_beam_search": True}, False),
    (CMPL, {"prompt": "hello", "kv_transfer_params": {"do_remote_decode": True}}, False),  # the client's own
    (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, True),
    (CHAT, {"messages": [], "response_format": {"type": "json_object"}}, False),
    (CHAT, {"messages": [], "response_format": {"type": "text"}}, True),
    (CHAT, {"messages": [], "guided_regex": "a+"}, False),
    (CHAT, {"messages": [], "tool_choice": "required"}, False),
    (CHAT, {"messages": [], "tool_choice": "auto"}, True),
    ("/v1/embeddings", {"input": "hi"}, False),
])
def test_what_is_split(path: str, body: dict[str, Any], split: bool) -> None:
    assert splittable(path, body) is split


def test_the_prefill_copy_computes_one_token_and_answers_once() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    copy = prefill_body(body)
    assert copy == {"prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1, "stream": False,
                    "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the decode instance gets the original


def test_bad_urls_and_no_decode_instance_are_refused() -> None:
    with pytest.raises(ValueError, match="--decode"):
        build_disagg_app(DisaggConfig(prefill=("http://127.0.0.1:1",), workers=()))
    with pytest.raises(ValueError, match="http://"):
        build_disagg_app(DisaggConfig(prefill=("127.0.0.1:1",), workers=("http://127.0.0.1:2",)))


def test_the_command_refuses_no_decode_instance(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.entrypoints.cli import main

    assert main(["disagg-proxy", "--prefill", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("tokenmill: error: give at least one --decode URL")
