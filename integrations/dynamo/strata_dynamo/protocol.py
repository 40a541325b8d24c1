"""Dynamo's token request → strata's `/v1/completions` body, and strata's streamed chunks
→ Dynamo's response chunks.

Dynamo's frontend tokenizes, detokenizes and applies stop strings and hidden stop tokens
itself (its `Backend` stage); strata gets token ids and returns token ids
(`return_token_ids`), stopping at the model's end-of-sequence ids unless `ignore_eos`.
"""

from __future__ import annotations

from typing import Any, Optional

from dynamo.llm.exceptions import InvalidArgument

# Sampling options strata has no equivalent for, with the value that changes nothing.
_NEUTRAL = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "length_penalty": 1.0,
    "n": 1,
    "best_of": 1,
    "use_beam_search": False,
    "guided_decoding": None,
}


def completion_body(model: str, request: dict[str, Any]) -> dict[str, Any]:
    """The strata request for a Dynamo `GenerateRequest`. Options strata cannot honour
    are refused (InvalidArgument, a 400 at the frontend) rather than silently ignored."""
    token_ids = request.get("token_ids") or []
    if not token_ids:
        raise InvalidArgument("the request has no prompt token ids")
    sampling = request.get("sampling_options") or {}
    stop = request.get("stop_conditions") or {}
    for key, neutral in _NEUTRAL.items():
        value = sampling.get(key)
        if value is not None and value != neutral:
            raise InvalidArgument(f"strata does not support the sampling option {key}={value!r}")
    if stop.get("min_tokens"):
        raise InvalidArgument("strata does not support min_tokens")
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(token_ids),
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": bool(stop.get("ignore_eos")),
    }
    if stop.get("max_tokens") is not None:
        body["max_tokens"] = stop["max_tokens"]
    for key in ("temperature", "top_p", "top_k", "seed"):
        if sampling.get(key) is not None:
            body[key] = sampling[key]
    return body


def sse_data(line: bytes) -> Optional[str]:
    """The payload of an SSE `data:` line (`[DONE]` included); `None` for other lines."""
    text = line.decode("utf-8").strip()
    if not text.startswith("data:"):
        return None
    return text[len("data:") :].strip()


def dynamo_chunk(
    payload: dict[str, Any], prompt_tokens: int, generated: int
) -> Optional[dict[str, Any]]:
    """A strata completion chunk as Dynamo's response chunk; `generated` counts the
    tokens sent before it. Raises on an error event; `None` for a chunk with nothing."""
    if "error" in payload:
        raise RuntimeError(f"strata: {payload['error'].get('message', payload['error'])}")
    choices = payload.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    ids = choice.get("token_ids") or []
    out: dict[str, Any] = {"token_ids": ids, "index": 0}
    finish = choice.get("finish_reason")
    if finish is not None:
        total = generated + len(ids)
        out["finish_reason"] = finish
        out["completion_usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": total,
            "total_tokens": prompt_tokens + total,
        }
    elif not ids:
        return None
    return out
