"""The OpenAI-compatible HTTP frontend over a GenerateBackend.

    app = build_openai_app(backend, Tokenizer.from_dir(model_dir))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Per request: validate (protocol.py), tokenize (through the chat template for chat), fit the
context, iterate `backend.generate`, detokenize incrementally, cut at stop strings, and answer
with JSON or server-sent events. All text and JSON work happens here, in the frontend's event
loop; the backend sees token ids only. Whenever a request ends before the backend finished it
(a stop string, a client that went away, an error), its iterator is closed, which releases it
in the backend (GenerateBackend's contract): the frontend sends no abort of its own.

Routers and engines serve it through microserve/http_server.py (listen_socket: TCP_NODELAY).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

import llguidance

from microserve import __version__
from microserve.backend import CLIENT, BackendError, Client, GenerateBackend
from microserve.client_streams import ClientDisconnected, EventStream, unless_disconnected
from microserve.errors import (OpenAIError, from_validation_errors, install_error_handlers,
                               invalid_request,
                               model_not_found)
from microserve.metrics import CONTENT_TYPE, Registry
from microserve.vllm_metrics import RequestMetrics
from microserve.model_config import sampling_defaults
from microserve.openai.reasoning import REASONING_PARSERS, ThinkSplitter
from microserve.openai.responses import ChatWire, CompletionWire, model_card, model_list, usage
from microserve.openai.responses_api import ResponsesRequest, chat_request, renamed
from microserve.openai.responses_writer import ResponseWriter
from microserve.openai.responses_writer import usage as responses_usage
from microserve.openai.limits import check_choices, fit_context
from microserve.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                        MAX_TOKENIZE, DetokenizeRequest, GenerationRequest,
                                        TokenizeRequest)
from microserve.openai.guided import checked, request_grammar
from microserve.tokenizer import ChatTemplateError, IncrementalDetokenizer, StopChecker, Tokenizer
from microserve.openai.tool_parsers import ToolParser, make_parser
from microserve.openai.tools import forced_functions, forces_calls, parses_calls
from microserve.messages import FinishReason, GenerateChunk, TokenLogprob
from microserve.openai.middleware import CountRequests, LimitBody
from microserve.openai.runs import (Delta, Run, all_or_none, close_all, collect, run_id, sse,
                                    stream_error)
from microserve.request_checks import check_sampling, out_of_vocab

log = logging.getLogger(__name__)
BodyT = TypeVar("BodyT", bound=BaseModel)

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


async def _parse_body(raw: Request, model: type[BodyT]) -> BodyT:
    """Validate the JSON body whatever its content type (`curl -d` sends form-urlencoded)."""
    try:
        return model.model_validate_json(await raw.body())
    except ValidationError as e:
        raise from_validation_errors(e.errors()) from None


class OpenAIFrontend:
    """The OpenAI endpoints over one backend and its tokenizer; see `build_openai_app`."""

    def __init__(self, backend: GenerateBackend, tokenizer: Tokenizer, registry: Registry,
                 tool_parser: ToolParser, sampling_defaults: dict | None = None,
                 reasoning_parser: str | None = None):
        self.backend, self.tokenizer, self.registry = backend, tokenizer, registry
        self.tool_parser = tool_parser
        if reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser {reasoning_parser!r} is not one of "
                             f"{', '.join(REASONING_PARSERS)}")
        self.reasoning_parser = reasoning_parser  # chat and responses split thinking off
        # the model's recommended sampling (build_openai_app), max_tokens apart
        defaults = dict(sampling_defaults or {})
        self._max_tokens_default = defaults.pop("max_tokens", None)
        self.sampling_defaults = defaults
        self.started = int(time.time())
        self.requests = registry.counter(
            "microserve_requests_total", "HTTP requests by endpoint and status.",
            ["endpoint", "status"])
        self._running = registry.gauge(
            "microserve_requests_running", "Generations in flight in this frontend.")
        self._ttft = registry.histogram(
            "microserve_time_to_first_token_seconds",
            "From request arrival to its first generated token.", TTFT_BUCKETS)
        self._tpot = registry.histogram(
            "microserve_time_per_output_token_seconds",
            "Per request: mean time per output token after the first.", TPOT_BUCKETS)
        self._prompt_tokens = registry.counter(
            "microserve_prompt_tokens_total", "Prompt tokens of requests that started generating.")
        self._generation_tokens = registry.counter(
            "microserve_generation_tokens_total", "Generated tokens.")
        self._cached_tokens = registry.counter(
            "microserve_prefix_cache_hit_tokens_total", "Prompt tokens served from a prefix cache.")
        self._vllm = RequestMetrics(registry, backend.model_name, TTFT_BUCKETS, TPOT_BUCKETS,
                                    backend.max_model_len)

    # -- endpoints ------------------------------------------------------------------------

    async def completions(self, raw: Request) -> Response:
        arrival = time.perf_counter()
        body = await _parse_body(raw, CompletionRequest)
        self._check_model(body.model)
        prompts = body.prompts
        check_choices(len(prompts), body.n)
        grammar, _ = request_grammar(body.guided_fields())
        token_text = None
        if body.logprobs is not None:
            token_text = _token_id_text if body.return_tokens_as_token_ids else (
                self.tokenizer.token_text)
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choices = []
        for number, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                prompt_ids = await self.tokenizer.encode_async(prompt)
            else:
                prompt_ids = self._checked_token_ids(prompt)
            whole = len(prompt_ids)
            prompt_ids = body.truncated(prompt_ids, self.backend.max_model_len)
            max_tokens = fit_context(self.backend.max_model_len, len(prompt_ids), body.max_tokens,
                                     "max_tokens", "prompt",
                                     self._default_max_tokens(body.default_max_tokens))
            echo = None
            if body.echo:  # the prompt as sent, or its (kept) tokens' text
                echo = (prompt if isinstance(prompt, str) and len(prompt_ids) == whole
                        else self.tokenizer.decode(prompt_ids))
            for i in range(body.n):
                index = len(choices)
                run = self._new_run(run_id(response_id, index, len(prompts) * body.n), body,
                                    prompt_ids, max_tokens, body.logprobs, arrival, grammar, i,
                                    echo=echo,
                                    choices_of=f"{response_id}/{number}" if body.n > 1 else None)
                wire = CompletionWire(response_id, self._served(body.model), created, token_text,
                                      index)
                choices.append((run, wire))
        return await self._respond(raw, body, choices)

    async def chat_completions(self, raw: Request) -> Response:
        arrival = time.perf_counter()
        body = await _parse_body(raw, ChatCompletionRequest)
        self._check_model(body.model)
        check_choices(1, body.n)
        grammar = self._chat_grammar(body)
        prompt_ids, max_tokens = await self._chat_prompt(body, body.max_tokens_field, "messages")
        token_bytes = None
        if body.logprobs:
            token_bytes = _token_id_bytes if body.return_tokens_as_token_ids else (
                self.tokenizer.token_bytes)
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = []
        for i in range(body.n):
            run = self._new_run(run_id(response_id, i, body.n), body, prompt_ids, max_tokens,
                                body.requested_logprobs, arrival, grammar, i,
                                choices_of=response_id if body.n > 1 else None)
            self._read_chat_output(run, body)
            choices.append((run, ChatWire(response_id, self._served(body.model), created,
                                          token_bytes, i)))
        return await self._respond(raw, body, choices)

    async def responses(self, raw: Request) -> Response:
        """OpenAI's Responses API, stateless (microserve/openai/responses_api.py): the chat
        request the body means, generated as one, answered as a response object or its
        stream of typed events."""
        arrival = time.perf_counter()
        body = await _parse_body(raw, ResponsesRequest)
        chat = chat_request(body)
        self._check_model(chat.model)
        writer = ResponseWriter(body, self._served(chat.model),
                                self.tokenizer.token_bytes if chat.logprobs else None)
        try:  # what chat would refuse, named as the Responses API names it
            grammar = self._chat_grammar(chat)
            prompt_ids, max_tokens = await self._chat_prompt(chat, "max_output_tokens", "input")
            run = self._new_run(writer.id, chat, prompt_ids, max_tokens, chat.requested_logprobs,
                                arrival, grammar)
        except OpenAIError as e:
            raise renamed(e, body) from None
        self._read_chat_output(run, chat)
        CLIENT.set(Client(chat.user, raw.headers))
        gen = self._deltas(run)
        try:
            if not body.stream:
                whole = await unless_disconnected(raw.receive, collect(gen))
                calls = [call for _, call in whole.tool_calls]
                return JSONResponse(writer.whole(whole.text, whole.logprobs, calls,
                                                 whole.finish_reason,
                                                 responses_usage(self._usage([run])),
                                                 whole.reasoning))
            first = await unless_disconnected(raw.receive, anext(gen))
        except ClientDisconnected:
            await close_all([gen])
            return Response(status_code=499)
        except BaseException:
            await close_all([gen])
            raise
        return EventStream(self._response_events(run, writer, first, gen),
                           headers={"Cache-Control": "no-cache"})

    async def _response_events(self, run: Run, writer: ResponseWriter, first: Delta,
                               deltas: AsyncGenerator[Delta, None]
                               ) -> AsyncGenerator[bytes, None]:
        try:
            for event in writer.events_opening():
                yield event
            delta, finish_reason = first, None
            while delta is not None:
                for event in writer.events_reasoning(delta.reasoning):
                    yield event
                for event in writer.events_text(delta.text, delta.logprobs):
                    yield event
                for _, call in delta.tool_calls:
                    for event in writer.events_call(call):
                        yield event
                finish_reason = delta.finish_reason or finish_reason
                delta = await anext(deltas, None)
            for event in writer.events_closing(finish_reason,
                                               responses_usage(self._usage([run]))):
                yield event
        except Exception as e:  # the backend failed mid-stream: the status line is gone
            for event in writer.events_failed(stream_error(e, run.request_id)["error"]):
                yield event
        finally:
            await deltas.aclose()

    async def tokenize(self, raw: Request) -> JSONResponse:
        """vLLM's POST /tokenize: the prompt's token ids as a completion would send them, or
        the messages' as a chat completion would (same template options)."""
        body = await _parse_body(raw, TokenizeRequest)
        self._check_model(body.model)
        if body.messages is not None:
            text = self._render_chat(body)
            special = bool(body.add_special_tokens)  # the template writes the BOS itself
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = await self.tokenizer.encode_async(text, add_special_tokens=special)
        if len(ids) > MAX_TOKENIZE:
            raise invalid_request(f"The text is {len(ids):,} tokens; /tokenize answers for at "
                                  f"most {MAX_TOKENIZE:,}", "messages" if body.messages
                                  else "prompt")
        strs = [self.tokenizer.token_text(i) for i in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.backend.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def detokenize(self, raw: Request) -> JSONResponse:
        """vLLM's POST /detokenize: token ids (below the vocabulary, else a 400 naming
        `tokens`) into text."""
        body = await _parse_body(raw, DetokenizeRequest)
        self._check_model(body.model)
        bad = out_of_vocab(body.tokens, self.tokenizer.vocab_size)
        if bad is not None:
            raise invalid_request(f"Token id {body.tokens[bad]} at position {bad} is out of "
                                  f"range for a vocabulary of {self.tokenizer.vocab_size} tokens",
                                  "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": __version__})

    async def models(self) -> JSONResponse:
        return JSONResponse(model_list(self.backend.model_name, self.started,
                                       self.backend.max_model_len, self.backend.lora_names()))

    async def model(self, model_id: str) -> JSONResponse:
        """GET /v1/models/{id}: the served model's card, or 404 model_not_found."""
        base = self.backend.model_name
        if model_id != base and model_id not in self.backend.lora_names():
            raise model_not_found(model_id)
        return JSONResponse(model_card(model_id, self.started, self.backend.max_model_len,
                                       parent=None if model_id == base else base))

    async def health(self) -> JSONResponse:
        if await self.backend.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics(self) -> Response:
        text = self.registry.render() + await self.backend.metrics_text()
        return Response(text, media_type=CONTENT_TYPE)

    # -- request preparation --------------------------------------------------------------

    async def _chat_prompt(self, body: ChatCompletionRequest, budget_field: str,
                           prompt_field: str) -> tuple[list[int], int]:
        """A chat request's prompt token ids (rendered, truncated as asked) and its output
        budget; a budget past the context is a 400 naming `budget_field` / `prompt_field`."""
        text = self._render_chat(body)
        # The template writes the BOS itself.
        prompt_ids = await self.tokenizer.encode_async(text, add_special_tokens=False)
        prompt_ids = body.truncated(prompt_ids, self.backend.max_model_len)
        max_tokens = fit_context(self.backend.max_model_len, len(prompt_ids),
                                 body.requested_max_tokens, budget_field, prompt_field,
                                 self._default_max_tokens(None))
        return prompt_ids, max_tokens

    def _read_chat_output(self, run: Run, body: ChatCompletionRequest) -> None:
        """Set up what a chat generation's text is read for: tool calls (with tools), and
        the thinking apart from the answer (--reasoning-parser)."""
        if parses_calls(body.tools, body.tool_choice):
            run.tool_calls = self.tool_parser.stream(forces_calls(body.tool_choice))
        if self.reasoning_parser is not None:
            run.reasoning = ThinkSplitter()

    def _render_chat(self, body: ChatCompletionRequest | TokenizeRequest) -> str:
        """The prompt text: tools and tool turns through the template when it renders them,
        else written into the messages in the tool-call parser's format."""
        messages = [m.template_dict() for m in body.messages]
        tools = [tool.template_dict() for tool in body.tools or ()]
        if not self.tokenizer.renders_tools:
            messages, tools = self.tool_parser.inline(messages, tools), []
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tools=tools or None,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs)
        except ChatTemplateError as e:
            raise invalid_request(str(e), "messages") from e

    def _chat_grammar(self, body: ChatCompletionRequest) -> str | None:
        """The grammar of a structured-output request or of a forced tool call, or None."""
        grammar, field_name = request_grammar(body.guided_fields())
        functions = forced_functions(body.tools or [], body.tool_choice)
        if not functions:
            return grammar
        if grammar is not None:
            raise invalid_request(f"{field_name} cannot be combined with a tool_choice that "
                                  "forces a tool call", "tool_choice")
        # A named function is called once; "required" may call several unless told not to.
        parallel = body.tool_choice == "required" and body.parallel_tool_calls
        lark = self.tool_parser.grammar(functions, parallel)
        return checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools")

    def _default_max_tokens(self, own: int | None) -> int | None:
        """The budget of a request without max_tokens: the endpoint's own default (None: the
        context left), capped by the model's generation config's max_new_tokens."""
        capped = [v for v in (own, self._max_tokens_default) if v is not None]
        return min(capped) if capped else None

    def _check_model(self, model: str | None) -> None:
        # An absent or empty model means the served one, as in vLLM.
        if model and model != self.backend.model_name and model not in self.backend.lora_names():
            raise model_not_found(model)

    def _served(self, model: str | None) -> str:
        """What answers name as their model: the base's name, or the LoRA adapter asked for."""
        return model if model and model != self.backend.model_name else self.backend.model_name

    def _checked_token_ids(self, ids: list[int]) -> list[int]:
        vocab_size = self.tokenizer.vocab_size
        bad = out_of_vocab(ids, vocab_size)
        if bad is not None:
            raise invalid_request(f"Token id {ids[bad]} at prompt position {bad} is out of range "
                                  f"for a vocabulary of {vocab_size} tokens", "prompt")
        return ids

    def _new_run(self, request_id: str, body: GenerationRequest, prompt_ids: list[int],
                 max_tokens: int, logprobs: int | None, arrival: float,
                 grammar: str | None, choice: int = 0, echo: str | None = None,
                 choices_of: str | None = None) -> Run:
        """`echo`: the prompt's text to put in front of the completion; with `logprobs`, the
        prompt tokens' logprobs go in front of the completion's too."""
        prompt_logprobs = logprobs if echo is not None else None
        if grammar is not None and body.allowed_token_ids:  # two masks that may leave nothing
            raise invalid_request("allowed_token_ids cannot be combined with a structured "
                                  "output or a forced tool call", "allowed_token_ids")
        params = body.sampling_params(max_tokens, logprobs, grammar, choice, prompt_logprobs,
                                      self.sampling_defaults)
        if (adapter := self._served(body.model)) != self.backend.model_name:
            params = replace(params, lora_name=adapter)
        check_sampling(params, self.tokenizer.vocab_size)  # pydantic bounded what an int holds
        return Run(request_id=request_id, prompt_ids=prompt_ids, params=params, stop=body.stop,
                   arrival=arrival, echo=echo, priority=body.priority, choices_of=choices_of,
                   include_stop=body.include_stop_str_in_output,
                   skip_special_tokens=body.skip_special_tokens)

    # -- generation -----------------------------------------------------------------------

    async def _respond(self, raw: Request, body: GenerationRequest,
                       choices: list[tuple[Run, CompletionWire | ChatWire]]) -> Response:
        """Answer the request's generations: one body, or one event stream. With several
        choices they run side by side and any one failing fails (and aborts) them all."""
        # Read where the backend generates (the tasks below and the event stream's copy this
        # context): a router's A/B experiment assigns arms by it.
        CLIENT.set(Client(body.user, raw.headers))
        gens = [self._deltas(run) for run, _ in choices]
        try:
            if not body.stream:
                wholes = await unless_disconnected(raw.receive,
                                                   all_or_none([collect(g) for g in gens]))
                bodies = [wire.body(w.text, w.logprobs, w.finish_reason, None, w.tool_calls,
                                    w.reasoning)
                          for (_, wire), w in zip(choices, wholes)]
                answer = bodies[0]
                answer["choices"] = [b["choices"][0] for b in bodies]
                answer["usage"] = self._usage([run for run, _ in choices])
                return JSONResponse(answer)
            # Wait for the first output before answering, so that a backend that cannot take
            # the request still gets a 503 status rather than an error event inside a 200.
            firsts = await unless_disconnected(raw.receive,
                                               all_or_none([anext(g) for g in gens]))
        except ClientDisconnected:
            await close_all(gens)
            return Response(status_code=499)  # nginx's "client closed request", for the metrics
        except BaseException:
            await close_all(gens)
            raise
        runs = [run for run, _ in choices]
        each = (lambda: self._usage(runs)) if body.continuous_usage else None
        if len(choices) == 1:
            run, wire = choices[0]
            events = self._events(run, wire, firsts[0], gens[0], body.include_usage, each)
        else:
            events = self._events_of_all(choices, firsts, gens, body.include_usage, each)
        return EventStream(events, headers={"Cache-Control": "no-cache"})

    async def _events(self, run: Run, wire: CompletionWire | ChatWire, first: Delta,
                      deltas: AsyncGenerator[Delta, None], include_usage: bool,
                      usage_each: Callable[[], dict] | None = None
                      ) -> AsyncGenerator[bytes, None]:
        """The SSE body: opening chunks, a chunk per delta, usage if asked for, then [DONE].
        `usage_each`: every chunk carries the usage so far (continuous_usage_stats)."""
        try:
            for chunk in wire.opening_chunks():
                yield _sse_with(chunk, usage_each)
            delta: Delta | None = first
            while delta is not None:
                for chunk in wire.delta_chunks(delta.text, delta.logprobs, delta.finish_reason,
                                               delta.tool_calls, delta.reasoning):
                    yield _sse_with(chunk, usage_each)
                delta = await anext(deltas, None)
            if include_usage:
                yield sse(wire.usage_chunk(self._usage([run])))
        except Exception as e:  # the backend failed mid-stream: the status line is gone already
            yield sse(stream_error(e, run.request_id))
        finally:
            await deltas.aclose()
        yield sse("[DONE]")

    async def _events_of_all(self, choices: list[tuple[Run, CompletionWire | ChatWire]],
                             firsts: list[Delta], gens: list[AsyncGenerator[Delta, None]],
                             include_usage: bool, usage_each: Callable[[], dict] | None = None
                             ) -> AsyncGenerator[bytes, None]:
        """`_events` for several choices: each one's chunks as its generation makes them,
        tagged with its index; one usage chunk for all. One failing ends them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, gen: AsyncGenerator[Delta, None]) -> None:
            try:
                async for delta in gen:
                    queue.put_nowait((k, delta, None))
                queue.put_nowait((k, None, None))
            except Exception as e:
                queue.put_nowait((k, None, e))

        pumps: list[asyncio.Task] = []
        try:
            for _, wire in choices:
                for chunk in wire.opening_chunks():
                    yield _sse_with(chunk, usage_each)
            for (_, wire), delta in zip(choices, firsts):
                for chunk in wire.delta_chunks(delta.text, delta.logprobs, delta.finish_reason,
                                               delta.tool_calls, delta.reasoning):
                    yield _sse_with(chunk, usage_each)
            pumps = [asyncio.create_task(pump(k, g)) for k, g in enumerate(gens)]
            running = len(gens)
            while running:
                k, delta, error = await queue.get()
                if error is not None:
                    raise error
                if delta is None:
                    running -= 1
                    continue
                for chunk in choices[k][1].delta_chunks(delta.text, delta.logprobs,
                                                        delta.finish_reason, delta.tool_calls,
                                                        delta.reasoning):
                    yield _sse_with(chunk, usage_each)
            if include_usage:
                yield sse(choices[0][1].usage_chunk(self._usage([r for r, _ in choices])))
        except Exception as e:
            yield sse(stream_error(e, choices[0][1].request_id))
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await close_all(gens)
        yield sse("[DONE]")

    async def _deltas(self, run: Run) -> AsyncGenerator[Delta, None]:
        """The request's new text per backend output, cut at the first stop string.

        Aborts the request in the backend unless the backend finished it: on a stop string,
        and when the consumer stops early or is cancelled (a client that went away).
        """
        detokenizer = IncrementalDetokenizer(self.tokenizer, run.skip_special_tokens,
                                             prompt_ids=run.prompt_ids)
        stop = StopChecker(run.stop, include=run.include_stop)
        outputs = self.backend.generate(run.request_id, run.prompt_ids, run.params,
                                        run.priority, run.choices_of)
        backend_finished = False
        self._running.inc()
        try:
            async for out in outputs:
                self._note_output(run, out)
                backend_finished = out.finish_reason is not None
                text = detokenizer.step(self._text_ids(run, out))
                if backend_finished:
                    text += detokenizer.flush()
                text = stop.feed(text)
                logprobs = out.logprobs or []
                if run.echo is not None:  # the first delta: the prompt in front (no stop check)
                    text, logprobs = run.echo + text, self._echoed(run, out) + logprobs
                    run.echo = None
                if stop.stopped:
                    run.finish_reason = FinishReason.STOP
                    yield self._delta(run, text, logprobs, FinishReason.STOP)
                    return
                if backend_finished:
                    run.finish_reason = out.finish_reason
                    text += stop.flush()
                yield self._delta(run, text, logprobs, out.finish_reason)
                if backend_finished:
                    # Let the backend finish its own work after the last output (the router:
                    # the strategy's end) before the response ends.
                    async for _ in outputs:
                        pass
                    return
        finally:
            self._running.dec()
            self._note_finished(run)
            if hasattr(outputs, "aclose"):  # closing it unfinished releases the request
                # Shielded: a cancelled request must still be released by the backend.
                await asyncio.shield(outputs.aclose())

    @staticmethod
    def _echoed(run: Run, out: GenerateChunk) -> list:
        """Echo's prompt logprobs: the first token's id alone (nothing scores it), then the
        engine's; none unless the request asked for logprobs."""
        if run.params.prompt_logprobs is None:
            return []
        if out.prompt_logprobs is None or len(out.prompt_logprobs) != len(run.prompt_ids):
            raise BackendError("the engine sent no prompt logprobs for an echo with logprobs")
        return [run.prompt_ids[0], *out.prompt_logprobs[1:]]

    def _delta(self, run: Run, text: str, logprobs: list[TokenLogprob],
               finish_reason: str | None) -> Delta:
        """A delta, with its thinking split off (--reasoning-parser) and the tool calls its
        answer completed taken out of it (chat with tools). A generation that stopped after
        calling tools finishes with "tool_calls"."""
        reasoning = None
        if run.reasoning is not None:
            reasoning, text = run.reasoning.feed(text)
            if finish_reason is not None:
                more_reasoning, more_text = run.reasoning.flush()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if run.tool_calls is None:
            return Delta(text, logprobs, finish_reason, reasoning=reasoning)
        text, calls = run.tool_calls.feed(text)
        if finish_reason is not None:
            more_text, more_calls = run.tool_calls.flush()
            text, calls = text + more_text, calls + more_calls
        indexed = [(run.num_tool_calls + i, call) for i, call in enumerate(calls)]
        run.num_tool_calls += len(calls)
        if finish_reason == FinishReason.STOP and run.num_tool_calls:
            finish_reason = "tool_calls"
        return Delta(text, logprobs, finish_reason, indexed, reasoning)

    def _text_ids(self, run: Run, out: GenerateChunk) -> list[int]:
        """The tokens that become text: a final stop token's or eos's text is left out
        (unless include_stop_str_in_output)."""
        ids = out.token_ids
        if out.finish_reason != FinishReason.STOP or not ids or run.include_stop:
            return ids
        last = ids[-1]
        if last in run.params.stop_token_ids or last == self.tokenizer.eos_token_id:
            return ids[:-1]
        return ids

    def _note_output(self, run: Run, out: GenerateChunk) -> None:
        now = time.perf_counter()
        # The first chunk says how many prompt tokens were cached, the last one's usage too.
        cached = out.usage.cached_tokens if out.usage is not None else out.cached_tokens
        if cached is not None:
            run.num_cached = max(run.num_cached, cached)
        if not out.token_ids:
            return
        if run.first_token_at is None:
            run.first_token_at = now
            self._ttft.observe(now - run.arrival)
            self._vllm.ttft.observe(now - run.arrival, **self._vllm.labels)
            self._prompt_tokens.inc(len(run.prompt_ids))
        run.last_token_at = now
        run.num_generated += len(out.token_ids)
        self._generation_tokens.inc(len(out.token_ids))

    def _note_finished(self, run: Run) -> None:
        if run.first_token_at is not None:
            self._cached_tokens.inc(run.num_cached)
        if run.first_token_at is not None and run.num_generated > 1:
            elapsed = run.last_token_at - run.first_token_at
            self._tpot.observe(elapsed / (run.num_generated - 1))
            self._vllm.tpot.observe(elapsed / (run.num_generated - 1), **self._vllm.labels)
        self._vllm.finished(run.arrival, time.perf_counter(), run.finish_reason,
                            len(run.prompt_ids),
                            run.num_generated if run.first_token_at is not None else None)

    @staticmethod
    def _usage(runs: list[Run]) -> dict:
        """The usage of a request's generations: each distinct prompt counted once (n choices
        share theirs), with the most of it any of its choices found cached."""
        prompts: dict[int, tuple[int, int]] = {}  # id(prompt_ids) -> (length, cached)
        for run in runs:
            _, cached = prompts.get(id(run.prompt_ids), (0, 0))
            prompts[id(run.prompt_ids)] = (len(run.prompt_ids), max(cached, run.num_cached))
        return usage(sum(n for n, _ in prompts.values()), sum(r.num_generated for r in runs),
                     sum(c for _, c in prompts.values()))


def model_sampling_defaults(model_dir: str, generation_config: str) -> dict:
    """What `build_openai_app` takes as `sampling_defaults` for a model directory under the
    `generation_config` setting (auto: its generation_config.json's; openai / vllm: none),
    logged as vLLM logs it, so an operator sees why unasked-for sampling changed."""
    if generation_config != "auto":
        return {}
    defaults, skipped = sampling_defaults(model_dir)
    if defaults:
        log.info("the model's generation_config.json sets the defaults of requests that leave "
                 "them out: %s (--generation-config openai keeps OpenAI's)",
                 ", ".join(f"{k} {v}" for k, v in defaults.items()))
    if skipped:
        log.warning("generation_config.json: not used as defaults: %s", "; ".join(skipped))
    return defaults


def _token_id_text(token_id: int) -> str:
    """A logprobs entry's token under vLLM's return_tokens_as_token_ids: its id, not text."""
    return f"token_id:{token_id}"


def _token_id_bytes(token_id: int) -> bytes:
    return _token_id_text(token_id).encode()


def _sse_with(chunk: dict, usage_each: Callable[[], dict] | None) -> bytes:
    """A stream chunk as an SSE event, with the usage so far when `usage_each` is given."""
    if usage_each is not None:
        chunk["usage"] = usage_each()
    return sse(chunk)


def build_openai_app(backend: GenerateBackend, tokenizer: Tokenizer, *,
                     registry: Registry | None = None,
                     tool_call_parser: str = "hermes",
                     larger_bodies: dict[str, int] | None = None,
                     sampling_defaults: dict | None = None,
                     reasoning_parser: str | None = None) -> FastAPI:
    """A FastAPI app serving the OpenAI API, /health and /metrics over `backend`.

    Args:
        backend: produces token ids; `model_name` and `max_model_len` are what the app serves.
        tokenizer: the model's tokenizer (chat template, detokenization).
        registry: where the frontend's metrics go; pass one to add your own metrics to the
            same /metrics page (the backend's `metrics_text()` is appended there too).
        tool_call_parser: the format of tool calls in the model's text
            (microserve/openai/tool_parsers.py: hermes, llama3_json).
        larger_bodies: paths whose request bodies may be larger than MAX_BODY_BYTES (an upload
            route added later), and how large.
        reasoning_parser: how a reasoning model's thinking is split from its answer in chat
            and responses (microserve/openai/reasoning.py: deepseek_r1); None: not split.
        sampling_defaults: what a request that leaves temperature, top_p, top_k, min_p,
            repetition_penalty or max_tokens out gets instead of OpenAI's defaults
            (microserve.model_config.sampling_defaults: the model's generation config).

    Returns:
        The app; add more routes (`app.include_router(...)`) before serving it. Every error it
        returns is OpenAI's error JSON.
    """
    frontend = OpenAIFrontend(backend, tokenizer, registry or Registry(),
                              make_parser(tool_call_parser), sampling_defaults, reasoning_parser)
    app = FastAPI(title="microserve")
    install_error_handlers(app)
    app.add_middleware(LimitBody, larger=larger_bodies)
    app.add_middleware(CountRequests, counter=frontend.requests)
    app.add_api_route("/v1/completions", frontend.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", frontend.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", frontend.responses, methods=["POST"])
    app.add_api_route("/v1/models", frontend.models, methods=["GET"])
    # :path, because model names may hold "/" (HuggingFaceTB/SmolLM2-135M-Instruct)
    app.add_api_route("/v1/models/{model_id:path}", frontend.model, methods=["GET"])
    app.add_api_route("/health", frontend.health, methods=["GET"])
    app.add_api_route("/tokenize", frontend.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", frontend.detokenize, methods=["POST"])
    app.add_api_route("/version", frontend.version, methods=["GET"])
    app.add_api_route("/metrics", frontend.metrics, methods=["GET"])
    return app
