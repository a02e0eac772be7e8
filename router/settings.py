"""The router's settings, each declared once: its default, its type and what it does.

Everything else is made from this declaration: the `microserve router` options and the
`microserve up` overrides (launcher/cli.py), the deployment file's keys (launcher/deployment.py:
the [router] table, and `tool_call_parser` at the top), and `RouterConfig` (router/server.py),
which is these settings plus what a running router is handed (its tokenizer, engines, secrets).

    setting             option                  deployment file
    queue_timeout_s     --queue-timeout-s       [router] queue_timeout_s
    http_limits         --max-connections, ...  [router] max_connections, ... (HttpLimits' fields)

Plain data, no I/O when built, no torch.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields

from microserve.backend import QUEUE_TIMEOUT_S
from microserve.http_limits import HttpLimits
from microserve.openai.reasoning import REASONING_PARSERS
from router.engines import LIVENESS_TIMEOUT_S

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# TOOL_CALL_PARSERS: microserve/openai/tool_parsers.py's PARSERS
BATCH_ORDERS = ("blend", "alternate", "dfs", "file")  # router/batches/order.py
GENERATION_CONFIGS = ("auto", "openai", "vllm")  # vllm: vLLM's name for openai


def _setting(default, help: str, *, file: str | None = "router", up: bool = False,
             flag: bool = True, **option) -> Field:
    """A setting's field. `file`: where a deployment file sets it ("router": its [router]
    table, "top": the file's top level, None: nowhere); `up`: `microserve up` may override
    the file's value with the option too; `flag`: `microserve router` takes it as an option;
    `option`: more of argparse's arguments (choices, metavar)."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(**factory, metadata={"help": help, "file": file, "up": up, "flag": flag,
                                      "option": option})


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    host: str = _setting("127.0.0.1", "the address it listens on (127.0.0.1 unless you mean "
                                      "it)", up=True)
    port: int = _setting(8000, "the port of its HTTP API (a deployment's engines follow it)",
                         up=True)
    # what each client connection may take; its fields are the options and keys
    http_limits: HttpLimits = _setting(HttpLimits, "what each client connection may take")
    strategy: str = _setting("data_parallel", "a built-in strategy (data_parallel, pd, "
                                              "balanced_pd, context_migration, auto) or a path "
                                              "to a .py file")
    strategy_args: dict = _setting(dict, "the strategy's constructor arguments (as JSON on the "
                                         "command line: '{\"ratio\": 0.2}')")
    watch_strategy: bool = _setting(False, "reload the strategy's file whenever it changes")
    strategies_dir: str | None = _setting(
        None, "the directory PUT /admin/strategy {\"path\": ...} may load .py files from "
              "(unset: built-ins and uploads only)", up=True)
    queue_timeout_s: float = _setting(
        QUEUE_TIMEOUT_S, "how long a request may wait for KV pages on a receiving engine, or for a "
              "prefill engine to start computing it, before it gets a 503 with Retry-After",
        up=True)
    liveness_timeout_s: float = _setting(
        LIVENESS_TIMEOUT_S, "an engine whose liveness probe gets no answer this long, or whose "
                            "core has sent no heartbeat this long (stopped, hung, cut off), is "
                            "marked down and the calls open on it end (a busy engine still "
                            "answers)", up=True)
    engine_streams: bool = _setting(
        False, "read each request's tokens from its engine on a connection of its own, as a "
               "stream, instead of on the one channel per engine that carries every request's "
               "(one read per engine step)")
    health_timeout_s: float = _setting(
        30.0, "how long a stats poll (an engine's load) may take; a later answer leaves the "
              "load as it was (--liveness-timeout-s decides what is down)")
    dns_interval_s: float = _setting(5.0, "seconds between lookups of the --engines-from-dns "
                                          "names", file=None)
    data_dir: str | None = _setting(
        None, "the directory the Files and Batches API keeps its files and database in "
              "(unset: that API is off; `microserve up` defaults it per port, under "
              "$XDG_DATA_HOME/microserve)", up=True, metavar="DIR")
    batch_lines_per_engine: int = _setting(
        8, "batch lines one engine runs at once while no live request is in flight; each live "
           "request in flight takes one of these slots away", up=True)
    batch_order: str = _setting(
        "blend", "the order a batch's lines run in: blend (BlendServe's resource-aware prefix "
                 "tree), alternate (the same tree's two ends taken in turn), dfs (the prefix "
                 "tree's depth-first order) or file (as written; for comparisons)", up=True,
        choices=BATCH_ORDERS)
    tool_call_parser: str = _setting(
        "hermes", "how tool calls look in the model's text (as vLLM's option): hermes "
                  "(<tool_call> blocks; also how tools are written into the prompt when the "
                  "chat template does not render them) or llama3_json", file="top",
        choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = _setting(
        None, "how a reasoning model's thinking is split from its answer in chat and responses "
              "(as vLLM's option): deepseek_r1 (up to the first </think>: DeepSeek-R1 and its "
              "Llama distillations; default: unset, not split)", file="top",
        choices=REASONING_PARSERS)

    chat_template: str | None = _setting(
        None, "the chat template to render chat requests with instead of the model's (as "
              "vLLM's option): a file's path, or the template itself (default: the model's)",
        file="top",
        metavar="FILE_OR_TEMPLATE")
    generation_config: str = _setting(
        "auto", "where a request's default temperature, top_p, top_k, min_p, repetition_penalty "
                "and max_tokens come from: auto (the model's generation_config.json, as vLLM "
                "and SGLang take it) or openai (OpenAI's defaults, the file ignored; vllm is "
                "vLLM's name for it)", file="top", choices=GENERATION_CONFIGS)

    def __post_init__(self):
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config {self.generation_config!r} is not one of "
                             f"{', '.join(GENERATION_CONFIGS)}")
        if not 0 < self.health_timeout_s <= 300:
            raise ValueError(f"health_timeout_s {self.health_timeout_s} must be in (0, 300]")
        if not 0.5 <= self.liveness_timeout_s <= 300:
            raise ValueError(f"liveness_timeout_s {self.liveness_timeout_s} must be in "
                             "[0.5, 300] (engine cores beat every 0.2 s)")
        if not 0 < self.queue_timeout_s <= 3600:  # NaN fails too
            raise ValueError(f"queue_timeout_s {self.queue_timeout_s} must be in (0, 3600]")
        if not 1 <= self.batch_lines_per_engine <= 4096:
            raise ValueError(f"batch_lines_per_engine {self.batch_lines_per_engine} must be in "
                             "[1, 4096]")
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(f"batch_order {self.batch_order!r} is not one of "
                             f"{', '.join(BATCH_ORDERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser {self.reasoning_parser!r} is not one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")

    def settings(self) -> dict:
        """The settings by name (a copy to build another settings object from)."""
        return {f.name: getattr(self, f.name) for f in fields(RouterSettings)}


SETTINGS: dict[str, Field] = {f.name: f for f in fields(RouterSettings)}
