"""The `openai` Python SDK: stream usage with stream_options={"include_usage": True}."""

import openai
from protocol import serve, usage


def client(step) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{step['base_url']}/v1", api_key=step["token"])


def text(step) -> dict:
    answer = client(step).chat.completions.create(
        model=step["model"], messages=[{"role": "user", "content": step["prompt"]}]
    )
    u = answer.usage
    return {
        "text": answer.choices[0].message.content,
        "model": answer.model,
        "usage": u and usage(u.prompt_tokens, u.completion_tokens, u.total_tokens),
        "extra": u and u.model_extra,
    }


def stream(step, include_usage: bool = True) -> dict:
    asks = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = client(step).chat.completions.create(
        model=step["model"],
        messages=[{"role": "user", "content": step["prompt"]}],
        stream=True,
        **asks,
    )
    parts, model, u = [], None, None
    for chunk in chunks:
        model = chunk.model or model
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            u = chunk.usage
    return {
        "text": "".join(parts),
        "model": model,
        "usage": u and usage(u.prompt_tokens, u.completion_tokens, u.total_tokens),
        "extra": u and u.model_extra,
    }


serve({"text": text, "stream": stream, "stream_no_usage": lambda step: stream(step, False)})
