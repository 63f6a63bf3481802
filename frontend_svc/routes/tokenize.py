"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend_svc.errors import invalid_parameter
from frontend_svc.protocol import parse_detokenize, parse_tokenize
from frontend_svc.routes.common import gateway, prompt_encoder, read_json


async def tokenize(request: Request) -> Response:
    state = gateway(request)
    body = await read_json(request)
    tokenizer, info = state.require_engine()
    req = parse_tokenize(body)
    state.check_model(req.model)
    encoder = prompt_encoder(request)
    if req.messages is not None:
        encoded = await encoder.encode_chat(
            tokenizer,
            req.messages,
            req.add_generation_prompt,
            req.template_kwargs,
            req.add_special_tokens,
        )
    else:
        assert req.prompt is not None
        encoded = (await encoder.encode(tokenizer, [req.prompt], req.add_special_tokens))[0]
    ids = encoded.ids
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": info.max_model_len,
            "tokens": ids,
            "token_strs": tokenizer.token_strings(ids) if req.return_token_strs else None,
        }
    )


async def detokenize(request: Request) -> Response:
    state = gateway(request)
    body = await read_json(request)
    tokenizer, info = state.require_engine()
    req = parse_detokenize(body)
    state.check_model(req.model)
    bad = next((t for t in req.tokens if t >= info.vocab_size), None)
    if bad is not None:
        raise invalid_parameter(
            f"Token id {bad} is out of the vocabulary (size {info.vocab_size}).", "tokens"
        )
    return JSONResponse({"prompt": tokenizer.decode(list(req.tokens), skip_special_tokens=False)})
