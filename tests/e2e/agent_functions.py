"""The agent function of tests/e2e/test_agent_function_runs.py, written as users write one:
the plain `openai` SDK against the endpoint it is given. It asks the question, then asks
again with its history whole, and answers with the first reply (which the task scores)."""

import openai


def ask_twice(example: dict, base_url: str, api_key: str, model: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": example["prompt"]}]
    answers = []
    for follow_up in ("Again:", None):
        reply = client.chat.completions.create(model=model, messages=messages)
        message = reply.choices[0].message
        answers.append(message.content or "")
        messages.append(message.model_dump(exclude_none=True))
        if follow_up is not None:
            messages.append({"role": "user", "content": f"{follow_up} {example['prompt']}"})
    return answers[0]
