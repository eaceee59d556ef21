"""The routes beside generation: `/health`, `/metrics` (Prometheus), the model card
(`/v1/models`, `/v1/models/{id}`), `/version`, and vLLM's `/tokenize`, `/detokenize` and
`/tokenizer_info` (what lm-eval's remote tokenizer reads: `local-completions` with
`tokenizer_backend=remote` then needs no tokenizer files of its own). Parsing and tokenizing run
on the server's parser threads, as the generation routes' do."""

from __future__ import annotations

from aiohttp import web

from cbjax import __version__
from cbjax.serve import protocol
from cbjax.serve.errors import APIError
from cbjax.serve.prometheus import CONTENT_TYPE


class InfoRoutes:
    def __init__(self, server):
        self.server = server
        self.llm = server.llm
        self.model_name = server.model_name

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)

    async def health(self, request: web.Request) -> web.Response:
        engine = self.server.engine
        if not engine.alive:
            raise APIError(503, engine.error or "the engine loop is not running")
        return json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        body = self.server.metrics.render(self.server.engine.load)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    def _card(self, name: str) -> dict:
        """A model's card: the base model's, or a LoRA adapter's (`parent`: the base, as vLLM's)."""
        card = {"id": name, "object": "model", "created": self.server.created, "owned_by": "cbjax",
                "root": name, "parent": None if name == self.model_name else self.model_name,
                "max_model_len": self.llm.max_model_len}
        return card

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._card(n) for n in self.server.served_models()]})

    async def model(self, request: web.Request) -> web.Response:
        name = protocol.check_model({"model": request.match_info["model_id"]}, self.server.served_models())
        return json_response(self._card(name))

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": __version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        """`prompt` (text or token ids) or chat `messages` to token ids."""
        def job(body):
            ids = parse_tokenize(body, self.model_name, self.llm.tokenizer, self.llm.max_model_len)
            return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.max_model_len}

        return json_response(await self.server.off_loop(request, job))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """The tokenizer's special tokens and chat template (vLLM's route)."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise APIError(404, "this model has no tokenizer")
        template = getattr(tokenizer, "chat_template", None)
        return json_response({"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                              "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                              "chat_template": None if template is None else str(template),
                              "model_max_length": self.llm.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        def job(body):
            return {"prompt": parse_detokenize(body, self.model_name, self.llm.tokenizer,
                                               self.llm.model.config.vocab_size)}

        return json_response(await self.server.off_loop(request, job))


def json_response(body: dict, status: int = 200) -> web.Response:
    return web.Response(text=protocol.dumps(body), status=status, content_type="application/json")


def parse_tokenize(body: dict, served: str, tokenizer, max_len: int) -> list[int]:
    """`/tokenize` (vLLM's): a text or token-id `prompt`, or chat `messages` with their template;
    `add_special_tokens` (default true) as the tokenizer takes it. An empty text is no tokens."""
    if protocol.require_object(body).get("model") is not None:
        protocol.check_model(body, served)
    if "messages" in body:
        return protocol.parse_chat({**body, "model": served}, served, tokenizer, max_len).prompts[0]
    special = protocol.get_field(body, "add_special_tokens", (bool,))
    if body.get("prompt") == "":
        return []
    prompts = protocol.prompt_list(body.get("prompt"))
    if len(prompts) != 1:
        raise protocol.bad("'prompt' must be one prompt", "prompt")
    if special is False and isinstance(prompts[0], str) and tokenizer is not None:
        protocol.check_text_length(len(prompts[0].encode("utf-8", "replace")), tokenizer, max_len, "prompt")
        return [int(t) for t in tokenizer(prompts[0], add_special_tokens=False)["input_ids"]]
    return protocol.prompt_ids(prompts[0], tokenizer, max_len)


def parse_detokenize(body: dict, served: str, tokenizer, vocab_size: int) -> str:
    """`/detokenize`: `tokens` (ids within the vocabulary) to text."""
    if protocol.require_object(body).get("model") is not None:
        protocol.check_model(body, served)
    ids = protocol.get_field(body, "tokens", (list,), allow_none=False)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise protocol.bad(f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
    if tokenizer is None:
        raise protocol.bad("this model has no tokenizer", "tokens")
    return tokenizer.decode(ids)
