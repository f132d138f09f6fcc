"""What the SGLang runtime answers: a completion's text and choice as the PyTorch adapter
makes them, a generate request's choices gathered into one result, an encode request's
vectors, and the failures more than one path gives."""

from __future__ import annotations

from typing import Any

from runtimes.base import Outcome, Request, failed
from runtimes.sglang.model import ServedModel
from tasks.errors import ErrorCode


def completion_text(model: ServedModel, output: list[int], stops: tuple[str, ...]) -> str:
    """The completion's text as the PyTorch adapter makes it: decoded without special
    tokens, cut before the first stop string."""
    text = model.decode(output)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def choice(model: ServedModel, index: int, prompt: list[int], output: list[int], reason: str,
           stops: tuple[str, ...], ttft: float, itl: float) -> dict[str, Any]:
    return {"index": index, "text": completion_text(model, output, stops),
            "finish_reason": reason, "prompt_tokens": len(prompt),
            "completion_tokens": len(output), "ttft_ms": round(ttft, 3),
            "itl_ms": round(itl, 3)}


def generate_result(request: Request, choices: list[dict[str, Any] | Outcome]) -> Outcome:
    """The request's outcome from its items' choices: the first item's failure if any
    failed, else the choices with their token usage summed."""
    errors = [c for c in choices if isinstance(c, Outcome)]
    if errors:
        return errors[0]
    answers: list[dict[str, Any]] = [c for c in choices if not isinstance(c, Outcome)]
    prompt = sum(c["prompt_tokens"] for c in answers)
    completion = sum(c["completion_tokens"] for c in answers)
    # Latencies beside the choices, as the PyTorch adapter reports them.
    latency = [{"ttft_ms": c.pop("ttft_ms"), "itl_ms": c.pop("itl_ms")} for c in answers]
    return Outcome(request.id, result={"choices": answers, "latency": latency,
                                       "usage": {"tokens": prompt + completion,
                                                 "prompt_tokens": prompt,
                                                 "completion_tokens": completion}})


def encode_result(request: Request, parsed: Any, tokens: list[list[int]],
                  data: Any) -> Outcome:
    """The request's vectors from SGLang's `/encode` answer (one row, or a list of rows)."""
    import numpy as np

    from runtimes.families.vectors import dense_result

    rows = data if isinstance(data, list) else [data]
    vectors = np.asarray([row["embedding"] for row in rows], dtype=np.float32)
    result = dense_result(vectors, parsed.options, True, sum(len(t) for t in tokens))
    return Outcome(request.id, result=result)


def unavailable(model: ServedModel, request: Request) -> Outcome:
    return failed(request.id, ErrorCode.MODEL_UNAVAILABLE,
                  f"the SGLang server for {model.entry.id} died and could not be "
                  f"restarted: {model.broken}")


def deadline_exceeded(request: Request) -> Outcome:
    return failed(request.id, ErrorCode.DEADLINE_EXCEEDED,
                  "the request's deadline passed before it was answered; SGLang "
                  "stopped generating for it")
