"""Simon Willison's `llm`, its models configured in extra-openai-models.yaml under LLM_USER_PATH
(the test writes it, as a user would): a model id `metering-<model>` per model. `llm` asks for
stream usage on every stream."""

import llm
from protocol import serve, usage


def prompt(step, stream: bool) -> dict:
    model = llm.get_model(f"metering-{step['model']}")
    response = model.prompt(step["prompt"], key=step["token"], stream=stream)
    text = "".join(response) if stream else response.text()
    u = response.usage()
    return {
        "text": text,
        "model": (response.response_json or {}).get("model"),
        "usage": usage(u.input, u.output, None),
    }


serve({"text": lambda step: prompt(step, False), "stream": lambda step: prompt(step, True)})
