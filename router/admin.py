"""The router's ops API (docs/router.md, "Hot swap and the ops API"): strategy, engines, migration,
pinning.

    GET    /admin/strategy                 the active strategy, its version, and retired ones
    PUT    /admin/strategy                 {"builtin" | "path" | "source", "class"?, "args"?},
                                           or {"arms": [...], "sticky_by"?, "slo"?} (A/B)
    PATCH  /admin/strategy/arms/{name}     {"weight"}: re-weight one arm (0 stops it)
    GET    /admin/engines                  every engine: state, role, open calls, polled load
    POST   /admin/engines                  {"name", "url", "role"?}: add one (it must answer)
    POST   /admin/engines/{name}/drain     no new requests; the ones it has finish
    POST   /admin/engines/{name}/undrain
    POST   /admin/engines/{name}/role      {"role", "wait_s"?}: drain its old role's work, flip
    DELETE /admin/engines/{name}           out of the pool (its requests in flight finish)
    POST   /admin/migrate                  {"prompt" | "text", "source", "destination", "pin"?,
                                            "lora_name"?}
    POST   /admin/pin, /admin/unpin        {"prompt" | "text", "engines"?}
    POST   /admin/load_lora_adapter        {"lora_name", "lora_path"}: on every engine
    POST   /admin/unload_lora_adapter      {"lora_name"}: on every engine

Every route needs the admin token (`Authorization: Bearer TOKEN`), GETs included: they show
engine URLs and strategy arguments, which are the deployment's business. Without an admin token
configured the whole API is closed (`microserve router` and `up` generate one when none is
given). `path` loads only .py files inside the router's strategies directory (--strategies-dir).

Every answer is JSON; every error OpenAI's error JSON: 400 a bad field or a strategy that did not
load (with why), 401 no or wrong admin token, 403 the admin API closed or a path given with no
strategies directory configured, 404 unknown engine, 409 a strategy load already running, 503 an
engine unreachable.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from microserve.bounds import TokenId
from microserve.errors import OpenAIError, from_validation_errors, invalid_request
from microserve.messages import SamplingParams
from microserve.tokenizer import Tokenizer
from router.engines import EnginePool, EngineSpec, UnknownEngine
from router.arm_stats import Slo
from router.arms import check_sticky_by
from router.host import ArmSpec, StrategyHost, StrategyLoadError, StrategySource, SwapInProgress
from router.roles import FlipInProgress
from router.split_migration import SplitRates, split_migrate
from router.strategy import Request as StrategyRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _exactly_one(body: BaseModel, fields: tuple[str, ...]) -> None:
    given = [f for f in fields if getattr(body, f) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(fields)} (got "
                         f"{', '.join(given) or 'none'})")


MAX_ARMS = 16
Weight = Annotated[float, Field(ge=0, le=1e6)]


class _Spec(_Body):
    builtin: str | None = None  # a module of strategies/: "pd"
    path: str | None = None  # a .py file in the router's strategies directory
    source: str | None = None  # the module's text
    filename: str = "upload.py"  # shown in tracebacks of uploaded source
    class_: str | None = Field(None, alias="class")
    args: dict[str, Any] = Field(default_factory=dict)


class ArmBody(_Spec):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    weight: Weight = 1.0

    @model_validator(mode="after")
    def _one_source(self):
        _exactly_one(self, ("builtin", "path", "source"))
        return self


class SloBody(_Body):
    ttft_s: float = Field(Slo.ttft_s, gt=0, le=3600)
    tpot_s: float = Field(Slo.tpot_s, gt=0, le=3600)


class StrategyBody(_Spec):
    arms: list[ArmBody] | None = Field(None, min_length=1, max_length=MAX_ARMS)  # an A/B
    sticky_by: str | None = Field(None, max_length=300)  # "request_id" (default), "user",
    slo: SloBody | None = None                              # "header:NAME"

    @model_validator(mode="after")
    def _one_source(self):
        _exactly_one(self, ("builtin", "path", "source", "arms"))
        if self.arms is None:
            given = [f for f in ("sticky_by", "slo") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} go with arms only")
            return self
        given = [f for f in ("class_", "args") if f in self.model_fields_set]
        if given:
            raise ValueError(f"{', '.join(g.rstrip('_') for g in given)} go inside each arm "
                             "when arms are given")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        if sum(a.weight for a in self.arms) <= 0:
            raise ValueError(f"the arms' weights must have a positive sum, got "
                             f"{[a.weight for a in self.arms]}")
        self.sticky_by = check_sticky_by(self.sticky_by or "request_id")
        self.slo = self.slo or SloBody()
        return self


class WeightBody(_Body):
    weight: Weight


class EngineBody(_Body):
    name: str = Field(min_length=1)
    url: str = Field(min_length=1)
    role: str = "any"


class RoleBody(_Body):
    role: Literal["prefill", "decode", "any"]
    wait_s: float = Field(30.0, ge=0, le=600)  # then it flips with the old work still open


class _Tokens(_Body):
    prompt: list[TokenId] | None = Field(None, min_length=1)  # token ids
    text: str | None = Field(None, min_length=1)  # tokenized without special tokens

    @model_validator(mode="after")
    def _one_context(self):
        _exactly_one(self, ("prompt", "text"))
        return self


class MigrateBody(_Tokens):
    source: str
    destination: str
    pin: bool = False
    # BlockLLM's split (router/split_migration.py): the share of the context the destination
    # computes itself while the source copies the rest, or "auto" (from measured rates);
    # None: the source sends it all
    split: Annotated[float, Field(ge=0, lt=1)] | Literal["auto"] | None = None
    # the LoRA adapter the context's KV is of (both engines must have it); None: the base
    lora_name: str | None = Field(None, min_length=1, max_length=256)


class PinBody(_Tokens):
    engines: list[str] | None = None  # default: every engine in the pool


class LoraBody(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str | None = Field(None, min_length=1, max_length=4096)  # load: required


async def _body(raw: Request, model: type[_Body]) -> Any:
    try:
        return model.model_validate_json(await raw.body())
    except ValidationError as e:
        raise from_validation_errors(e.errors()) from None


class AdminAPI:
    def __init__(self, pool: EnginePool, host: StrategyHost, tokenizer: Tokenizer,
                 strategies_dir: Path | None = None):
        self.pool, self.host, self.tokenizer = pool, host, tokenizer
        self.strategies_dir = strategies_dir  # where `path` may point; None: nowhere
        self.split_rates = SplitRates()  # what /admin/migrate's split "auto" goes by

    async def get_strategy(self) -> JSONResponse:
        return JSONResponse(self.host.describe())

    async def put_strategy(self, raw: Request) -> JSONResponse:
        body: StrategyBody = await _body(raw, StrategyBody)
        if body.arms is not None:
            return await self._put_arms(body)
        try:
            source = self._source(body)
            loaded = await self.host.load(source, body.args, body.class_)
        except StrategyLoadError as e:
            raise invalid_request(str(e), _source_field(body)) from None
        except SwapInProgress as e:
            raise OpenAIError(409, str(e)) from None
        return JSONResponse(loaded.describe())

    async def _put_arms(self, body: StrategyBody) -> JSONResponse:
        specs = []
        for i, arm in enumerate(body.arms):
            try:
                source = self._source(arm, f"arms.{i}.")
            except StrategyLoadError as e:
                raise invalid_request(f"arm {arm.name!r}: {e}",
                                      f"arms.{i}.{_source_field(arm)}") from None
            specs.append(ArmSpec(arm.name, source, arm.args, arm.class_, arm.weight))
        try:
            experiment = await self.host.load_arms(
                specs, body.sticky_by, Slo(body.slo.ttft_s, body.slo.tpot_s))
        except StrategyLoadError as e:
            raise invalid_request(str(e), "arms") from None
        except SwapInProgress as e:
            raise OpenAIError(409, str(e)) from None
        return JSONResponse(experiment.describe())

    def _source(self, spec: _Spec, where: str = "") -> StrategySource:
        if spec.path is not None and self.strategies_dir is None:
            raise OpenAIError(403, "Loading strategy files is off: start the router with "
                              "--strategies-dir DIR to load .py files from DIR, or upload the "
                              "module's text as 'source'.", param=where + "path")
        if spec.builtin is not None:
            return StrategySource.builtin(spec.builtin)
        if spec.path is not None:
            return StrategySource.file(spec.path, root=self.strategies_dir)
        return StrategySource.upload(spec.source, spec.filename)

    async def patch_arm(self, name: str, raw: Request) -> JSONResponse:
        body: WeightBody = await _body(raw, WeightBody)
        try:
            self.host.reweight(name, body.weight)
        except KeyError:
            experiment = self.host.experiment
            known = (", ".join(a.name for a in experiment.arms) if experiment
                     else "none: no experiment is running")
            raise OpenAIError(404, f"no A/B arm {name!r} (arms: {known})",
                              param="name") from None
        except ValueError as e:
            raise invalid_request(str(e), "weight") from None
        return JSONResponse(self.host.experiment.describe())

    async def list_engines(self) -> JSONResponse:
        return JSONResponse({"engines": self.pool.describe()})

    async def add_engine(self, raw: Request) -> JSONResponse:
        body: EngineBody = await _body(raw, EngineBody)
        try:
            spec = EngineSpec(body.name, body.url, body.role)
            await self.pool.add(spec, source="admin")
        except ValueError as e:
            raise invalid_request(str(e)) from None
        return JSONResponse(self._engine(body.name), status_code=201)

    async def drain_engine(self, name: str) -> JSONResponse:
        self._known(name)
        self.pool.drain(name)
        return JSONResponse(self._engine(name))

    async def undrain_engine(self, name: str) -> JSONResponse:
        self._known(name)
        self.pool.undrain(name)
        return JSONResponse(self._engine(name))

    async def set_role(self, name: str, raw: Request) -> JSONResponse:
        body: RoleBody = await _body(raw, RoleBody)
        self._known(name)
        try:
            return JSONResponse(await self.pool.roles.flip(name, body.role, body.wait_s))
        except FlipInProgress as e:
            raise OpenAIError(409, str(e)) from None

    async def remove_engine(self, name: str) -> JSONResponse:
        self._known(name)
        handle = self.pool.remove(name)
        return JSONResponse({"removed": name, "open_calls": handle.open_calls})

    async def migrate(self, raw: Request) -> JSONResponse:
        """Move a context: prep_recv on the destination, remote_send from the source, commit."""
        body: MigrateBody = await _body(raw, MigrateBody)
        source, destination = self._known(body.source), self._known(body.destination)
        if source is destination:
            raise invalid_request(f"source and destination are both {source.name!r}",
                                  "destination")
        prompt = self._tokens(body)
        request = StrategyRequest(f"migrate-{uuid.uuid4().hex}", prompt,
                                  SamplingParams(max_tokens=1, lora_name=body.lora_name))
        if body.split is not None:
            share = (self.split_rates.share(source.name, destination.name, len(prompt))
                     if body.split == "auto" else body.split)
            return JSONResponse(await split_migrate(self.pool, source, destination, request,
                                                    share, self.split_rates, body.pin))
        try:
            recv = await destination.prep_recv(request, end=len(prompt))
            sent = None
            if recv.matched < len(prompt):
                sent = await source.remote_send(request, recv.matched, len(prompt), recv.kv_addr)
            committed = await destination.commit(request, body.pin)
        except BaseException:
            await asyncio.shield(self.pool.release(request))
            raise
        return JSONResponse({
            "tokens": len(prompt), "already_cached": recv.matched,
            "sent": sent.sent if sent else 0, "computed": sent.computed if sent else 0,
            "reused": sent.reused if sent else 0, "cached": committed.cached,
            "pinned": committed.pinned})

    async def pin(self, raw: Request) -> JSONResponse:
        return await self._pin(raw, unpin=False)

    async def unpin(self, raw: Request) -> JSONResponse:
        return await self._pin(raw, unpin=True)

    async def _pin(self, raw: Request, unpin: bool) -> JSONResponse:
        body: PinBody = await _body(raw, PinBody)
        engines = [self._known(n) for n in body.engines] if body.engines else list(self.pool)
        prompt = self._tokens(body)
        out = {}
        for engine in engines:
            answer = await (engine.unpin(prompt) if unpin else engine.pin(prompt))
            out[engine.name] = answer.tokens
        return JSONResponse({"tokens": out})

    async def load_lora(self, raw: Request) -> JSONResponse:
        body: LoraBody = await _body(raw, LoraBody)
        if body.lora_path is None:
            raise invalid_request("lora_path is required", "lora_path")
        return await self._on_every_engine(lambda e: e.load_lora(body.lora_name,
                                                                 body.lora_path))

    async def unload_lora(self, raw: Request) -> JSONResponse:
        body: LoraBody = await _body(raw, LoraBody)
        return await self._on_every_engine(lambda e: e.unload_lora(body.lora_name))

    async def _on_every_engine(self, call) -> JSONResponse:
        """`call(engine)` on every engine in the pool at once: their answers by engine, or
        the first failure's status with every failure named (those that succeeded stay
        done: a load is undone with an unload)."""
        engines = list(self.pool)
        if not engines:
            raise OpenAIError(503, "no engines in the pool", type="server_error")
        results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
        failed = [(e.name, r) for e, r in zip(engines, results) if isinstance(r, Exception)]
        if failed:
            status = getattr(failed[0][1], "status", 503)
            raise OpenAIError(status, "; ".join(f"engine {name}: {error}"
                                                for name, error in failed),
                              type="server_error" if status >= 500 else "invalid_request_error",
                              param=getattr(failed[0][1], "param", None))
        return JSONResponse({"engines": {e.name: msgspec.to_builtins(r)
                                         for e, r in zip(engines, results)}})

    # -- helpers --------------------------------------------------------------------------------

    def _known(self, name: str):
        try:
            return self.pool[name]
        except UnknownEngine as e:
            raise OpenAIError(404, str(e), param="name") from None

    def _engine(self, name: str) -> dict:
        return next(e for e in self.pool.describe() if e["name"] == name)

    def _tokens(self, body: _Tokens) -> list[int]:
        if body.prompt is not None:
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in body.prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid_request(f"token id {bad} out of range for a vocabulary of {vocab}",
                                      "prompt")
            return body.prompt
        ids = self.tokenizer.encode(body.text, add_special_tokens=False)
        if not ids:
            raise invalid_request("text is empty after tokenization", "text")
        return ids


def _source_field(spec: _Spec) -> str:
    return "source" if spec.source is not None else "path" if spec.path is not None else "builtin"


def add_admin_routes(app: FastAPI, api: AdminAPI) -> None:
    routes = [
        ("/admin/strategy", api.get_strategy, "GET"),
        ("/admin/strategy", api.put_strategy, "PUT"),
        ("/admin/strategy/arms/{name}", api.patch_arm, "PATCH"),
        ("/admin/engines", api.list_engines, "GET"),
        ("/admin/engines", api.add_engine, "POST"),
        ("/admin/engines/{name}/drain", api.drain_engine, "POST"),
        ("/admin/engines/{name}/undrain", api.undrain_engine, "POST"),
        ("/admin/engines/{name}/role", api.set_role, "POST"),
        ("/admin/engines/{name}", api.remove_engine, "DELETE"),
        ("/admin/migrate", api.migrate, "POST"),
        ("/admin/pin", api.pin, "POST"),
        ("/admin/unpin", api.unpin, "POST"),
        ("/admin/load_lora_adapter", api.load_lora, "POST"),
        ("/admin/unload_lora_adapter", api.unload_lora, "POST"),
    ]
    for path, handler, method in routes:
        app.add_api_route(path, handler, methods=[method])
