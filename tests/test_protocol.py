"""OpenAI request validation (through the 400 it becomes) and the response JSON builders."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from microserve.errors import from_validation_errors
from microserve.openai.responses import ChatWire, CompletionWire, usage
from microserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from microserve.messages import SamplingParams, TokenLogprob


def error_of(model, body: dict):
    """The OpenAI error a bad body becomes: (status, param, message)."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = from_validation_errors(info.value.errors())
    return error.status_code, error.param, error.message


# -- requests --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]), ([5, 6], [[5, 6]]), (["hi"], ["hi"]), ([[5, 6]], [[5, 6]]),
    (["hi", "yo"], ["hi", "yo"]), ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts == expected


def test_defaults_become_sampling_params():
    request = CompletionRequest.model_validate({"prompt": "hi", "unknown_field": 1})
    assert request.max_tokens is None and request.stop == [] and not request.include_usage
    assert request.sampling_params(max_tokens=7, logprobs=None) == SamplingParams(max_tokens=7)


def test_sampling_fields_map_to_params():
    request = CompletionRequest(prompt="hi", temperature=0, top_p=0.5, top_k=-1, seed=3,
                                stop="x", stop_token_ids=[9], ignore_eos=True, logprobs=2,
                                min_p=0.05)  # fmt: skip
    params = request.sampling_params(max_tokens=4, logprobs=request.logprobs)
    assert params == SamplingParams(max_tokens=4, temperature=0.0, top_p=0.5, top_k=0, seed=3,
                                    stop_token_ids=(9,), ignore_eos=True, logprobs=2,
                                    min_p=0.05)  # fmt: skip
    assert params.greedy and request.stop == ["x"]


def test_penalties_logit_bias_and_min_tokens_map_to_params():
    request = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "presence_penalty": -2,
        "frequency_penalty": 1.5, "repetition_penalty": 1.3, "min_tokens": 3,
        "logit_bias": {"50": 100, "7": -0.5, "07": -1}})  # "07" is token 7 too: the last wins
    params = request.sampling_params(max_tokens=8, logprobs=None)
    assert params == SamplingParams(max_tokens=8, presence_penalty=-2.0, frequency_penalty=1.5,
                                    repetition_penalty=1.3, logit_bias=((7, -1.0), (50, 100.0)),
                                    min_tokens=3)
    assert params.needs_token_counts and params.adjusts_logits
    for only in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1},
                 {"repetition_penalty": 0.9}):
        assert CompletionRequest(prompt="hi", **only).sampling_params(4, None).needs_token_counts
    for only in ({"logit_bias": {"5": 0}}, {"min_tokens": 1}):
        p = CompletionRequest(prompt="hi", **only).sampling_params(4, None)
        assert p.adjusts_logits and not p.needs_token_counts
    plain = CompletionRequest(prompt="hi", presence_penalty=0, frequency_penalty=0,
                              repetition_penalty=1, logit_bias={}, min_tokens=0)
    assert plain.sampling_params(4, None) == SamplingParams(max_tokens=4)
    assert not SamplingParams().adjusts_logits


def test_too_many_logit_bias_entries_is_a_400():
    bias = {str(t): 1.0 for t in range(1025)}
    assert CompletionRequest(prompt="hi", logit_bias=dict(list(bias.items())[:1024]))
    status, param, message = error_of(CompletionRequest, {"prompt": "hi", "logit_bias": bias})
    assert (status, param) == (400, "logit_bias")
    assert message.startswith("Invalid value for 'logit_bias': at most 1024 entries, got 1025 "
                              '(got {"0": 1.0, ')


def test_openai_ranges_are_enforced_with_the_field_named():
    """OpenAI's documented ranges: temperature in [0, 2], at most 4 stop strings, known roles,
    content required except on assistant turns."""
    assert CompletionRequest(prompt="hi", temperature=2).temperature == 2
    bad = [
        (CompletionRequest, {"prompt": "hi", "temperature": 3.5}, ("temperature",),
         "Input should be less than or equal to 2"),
        (CompletionRequest, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, ("stop",),
         "Value error, at most 4 stop sequences, got 5"),
        (ChatCompletionRequest, {"messages": [{"role": "bogus", "content": "x"}]},
         ("messages", 0, "role"),
         "Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, ("messages", 0, "content"),
         "Value error, content is required in a 'user' message"),
    ]
    for model, body, loc, message in bad:
        with pytest.raises(ValidationError) as e:
            model(**body)
        assert (e.value.errors()[0]["loc"], e.value.errors()[0]["msg"]) == (loc, message)
    chat = ChatCompletionRequest(messages=[
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": None},
        {"role": "tool", "content": "4", "tool_call_id": "c1"}])
    assert [m.template_dict() for m in chat.messages] == [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": ""},
        {"role": "tool", "content": "4", "tool_call_id": "c1"}]


def test_include_usage_only_when_streaming():
    options = {"include_usage": True}
    assert CompletionRequest(prompt="hi", stream=True, stream_options=options).include_usage
    assert not CompletionRequest(prompt="hi", stream_options=options).include_usage


@pytest.mark.parametrize("field, value, says", [
    ("max_tokens", 0, "greater than or equal to 1"),
    ("temperature", -0.5, "greater than or equal to 0"),
    ("top_p", 0, "greater than 0"),
    ("top_p", 1.5, "less than or equal to 1"),
    ("top_k", -2, "greater than or equal to -1"),
    ("min_p", -0.1, "greater than or equal to 0"),
    ("min_p", 1.5, "less than or equal to 1"),
    ("logprobs", 21, "less than or equal to 20"),
    ("n", 0, "greater than or equal to 1"),
    ("n", 129, "less than or equal to 128"),
    ("suffix", "end", "suffix is not supported"),
    ("best_of", 3, "only best_of=1"),
    ("presence_penalty", 2.5, "less than or equal to 2"),
    ("frequency_penalty", -2.01, "greater than or equal to -2"),
    ("repetition_penalty", 0, "greater than 0"),
    ("repetition_penalty", 2.5, "less than or equal to 2"),
    ("logit_bias", {"abc": 1.0}, "key 'abc' is not a token id (an integer in [0, 2147483647])"),
    ("logit_bias", {"-5": 1.0}, "key '-5' is not a token id"),
    ("logit_bias", {"5": 150}, "bias 150 for token 5 is not a number in [-100, 100]"),
    ("logit_bias", {"5": "x"}, "bias 'x' for token 5 is not a number in [-100, 100]"),
    ("logit_bias", [5], "must be an object mapping token ids to biases"),
    ("min_tokens", -1, "greater than or equal to 0"),
    ("stop", 5, "must be a string or a list of strings"),
    ("stop", ["a", 1], "must be a string or a list of strings"),
    ("truncate_prompt_tokens", 0, "must be -1 (the context) or >= 1, got 0"),
    ("truncate_prompt_tokens", -2, "greater than or equal to -1"),
    ("use_beam_search", True, "use_beam_search is not supported"),
    ("bad_words", ["x"], "bad_words is not supported"),
])
def test_bad_completion_field_is_a_400_naming_field_and_value(field, value, says):
    status, param, message = error_of(CompletionRequest, {"prompt": "hi", field: value})
    assert (status, param) == (400, field)
    assert message.startswith(f"Invalid value for '{field}': ") and says in message
    assert message.endswith(f"(got {value!r})".replace("True", "true").replace("'", '"'))


def test_vllm_text_and_prompt_options():
    """Accepted at their defaults (what a client of vLLM may send unasked); the chat ones
    refuse what cannot work together."""
    body = CompletionRequest.model_validate({
        "prompt": "hi", "use_beam_search": False, "bad_words": [], "allowed_token_ids": None,
        "include_stop_str_in_output": True, "skip_special_tokens": False,
        "truncate_prompt_tokens": 3})
    assert body.include_stop_str_in_output and not body.skip_special_tokens
    assert CompletionRequest(prompt="hi", allowed_token_ids=[5, 3, 5]).sampling_params(
        4, None).allowed_token_ids == (5, 3)
    status, param, message = error_of(CompletionRequest, {"prompt": "hi",
                                                          "allowed_token_ids": [1, -2]})
    assert (status, param) == (400, "allowed_token_ids[1]")
    assert "greater than or equal to 0" in message
    assert body.truncated([1, 2, 3, 4, 5], 100) == [3, 4, 5]
    assert body.truncated([1, 2], 100) == [1, 2]
    whole = CompletionRequest(prompt="hi", truncate_prompt_tokens=-1)
    assert whole.truncated(list(range(10)), 4) == [6, 7, 8, 9]
    assert CompletionRequest(prompt="hi").truncated([1, 2, 3], 2) == [1, 2, 3]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    chat = ChatCompletionRequest.model_validate({
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.continue_final_message and chat.chat_template_kwargs == {"enable_thinking": False}
    assert error_of(ChatCompletionRequest, {"messages": messages,
                                            "continue_final_message": True})[1:] == (
        "continue_final_message", "Invalid value for 'continue_final_message': "
        "continue_final_message and add_generation_prompt cannot both be true (set "
        "add_generation_prompt to false) (got true)")
    assert error_of(ChatCompletionRequest, {"messages": messages, "echo": True})[1] == "echo"


def test_prompt_batches_and_refused_prompts():
    assert CompletionRequest(prompt="hi").prompts == ["hi"]
    assert CompletionRequest(prompt=[1, 2]).prompts == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    param, message = error_of(CompletionRequest, {"prompt": ["a"] * 129})[1:]
    assert param == "prompt" and message.startswith(
        "Invalid value for 'prompt': a batch of at most 128 prompts, got 129 (got [\"a\", ")
    assert error_of(CompletionRequest, {"prompt": []})[1] == "prompt"
    assert error_of(CompletionRequest, {"prompt": {"text": "hi"}})[1:] == (
        "prompt", "Invalid value for 'prompt': must be a string, a list of token ids, or a list "
                  'of either (got {"text": "hi"})')
    assert error_of(CompletionRequest, {"prompt": [1, "a"]})[1] == "prompt"
    assert error_of(CompletionRequest, {"prompt": [[1], [True]]})[1] == "prompt"
    assert error_of(CompletionRequest, {"prompt": ["a", [1]]})[1] == "prompt"


def test_missing_field_and_malformed_json():
    assert error_of(CompletionRequest, {}) == (400, "prompt", "Missing required field 'prompt'")
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(b'{"prompt": ')
    error = from_validation_errors(info.value.errors())
    assert (error.status_code, error.param) == (400, None)
    assert error.message.startswith("Malformed JSON body: EOF while parsing")


def test_chat_content_parts_are_joined():
    request = ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ])
    assert [m.template_dict() for m in request.messages] == [
        {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "", "name": "bot"}]


def test_chat_errors_name_nested_fields():
    image = {"type": "image_url", "image_url": {"url": "x"}}
    status, param, message = error_of(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": [image]}]})
    assert (status, param) == (400, "messages[0].content")
    assert "content parts of type 'image_url' are not supported" in message
    assert error_of(ChatCompletionRequest, {"messages": []})[1] == "messages"
    assert error_of(ChatCompletionRequest, {"messages": [{"content": "x"}]})[1:] == (
        "messages[0].role", "Missing required field 'messages[0].role'")


def test_chat_logprobs_and_max_tokens_fields():
    messages = [{"role": "user", "content": "hi"}]
    assert error_of(ChatCompletionRequest, {"messages": messages, "top_logprobs": 2})[1:] == (
        "top_logprobs",
        "Invalid value for 'top_logprobs': top_logprobs needs logprobs=true (got 2)")
    request = ChatCompletionRequest(messages=messages, logprobs=True, top_logprobs=3,
                                    max_tokens=5, max_completion_tokens=9)
    assert (request.requested_logprobs, request.requested_max_tokens) == (3, 9)
    assert request.max_tokens_field == "max_completion_tokens"
    plain = ChatCompletionRequest(messages=messages, max_tokens=5)
    assert (plain.requested_logprobs, plain.requested_max_tokens) == (None, 5)
    assert ChatCompletionRequest(messages=messages, logprobs=True).requested_logprobs == 0


# -- responses -------------------------------------------------------------------------------

TOKENS = {5: "he", 6: "llo", 7: " x"}
LOGPROBS = [TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.5)]),
            TokenLogprob(6, float("-inf"), [(7, -0.1)])]


def test_usage_counts_cached_prompt_tokens():
    assert usage(10, 3, 4) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                               "prompt_tokens_details": {"cached_tokens": 4}}


def test_completion_wire():
    wire = CompletionWire("cmpl-1", "m", 100, TOKENS.__getitem__)
    assert wire.chunk("hello", LOGPROBS, None) == {
        "id": "cmpl-1", "object": "text_completion", "created": 100, "model": "m",
        "choices": [{"index": 0, "text": "hello", "finish_reason": None, "logprobs": {
            "tokens": ["he", "llo"], "token_logprobs": [-0.5, -9999.0],
            "top_logprobs": [{"he": -0.5, " x": -1.5}, {" x": -0.1, "llo": -9999.0}],
            "text_offset": [0, 2]}}]}
    assert wire.chunk("", [TokenLogprob(7, -1.0)], "stop")["choices"][0]["logprobs"][
        "text_offset"] == [5]  # offsets continue across chunks
    assert wire.usage_chunk({"total_tokens": 1}) == {
        "id": "cmpl-1", "object": "text_completion", "created": 100, "model": "m",
        "choices": [], "usage": {"total_tokens": 1}}
    body = CompletionWire("cmpl-1", "m", 100, None).body("hello", [], "length", {"u": 1})
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"u": 1} and body["object"] == "text_completion"


def test_chat_wire():
    wire = ChatWire("chatcmpl-1", "m", 100, lambda t: TOKENS[t].encode())
    (opening,) = wire.opening_chunks()
    assert opening["object"] == "chat.completion.chunk"
    assert opening["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]
    chunk = wire.chunk("he", LOGPROBS[:1], None)
    assert chunk["choices"] == [{"index": 0, "delta": {"content": "he"}, "finish_reason": None,
                                 "logprobs": {"content": [{
                                     "token": "he", "logprob": -0.5, "bytes": [104, 101],
                                     "top_logprobs": [
                                         {"token": "he", "logprob": -0.5, "bytes": [104, 101]},
                                         {"token": " x", "logprob": -1.5, "bytes": [32, 120]}]}]}}]
    assert wire.chunk("", [], "stop")["choices"][0]["delta"] == {}
    body = ChatWire("chatcmpl-1", "m", 100, None).body("hello", [], "stop", {"u": 1})
    assert body == {"id": "chatcmpl-1", "object": "chat.completion", "created": 100, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                 "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"u": 1}}
