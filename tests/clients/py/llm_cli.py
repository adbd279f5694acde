"""Simon Willison's `llm`, its models configured in extra-openai-models.yaml under LLM_USER_PATH
(the test writes it, as a user would): a model id `metering-<model>` per model, and
`metering-requested-<model>` for the same model on the server whose catalog says
response_model = "requested" (a step whose base_url is not METERING_BASE_URL). `llm` asks for
stream usage on every stream."""

import llm
from protocol import BASE_URL, serve, usage


def prompt(step, stream: bool) -> dict:
    server = "" if step["base_url"] == BASE_URL else "requested-"
    model = llm.get_model(f"metering-{server}{step['model']}")
    response = model.prompt(step["prompt"], key=step["token"], stream=stream)
    text = "".join(response) if stream else response.text()
    u = response.usage()
    return {
        "text": text,
        "model": (response.response_json or {}).get("model"),
        "usage": usage(u.input, u.output, None),
    }


serve({"text": lambda step: prompt(step, False), "stream": lambda step: prompt(step, True)})
