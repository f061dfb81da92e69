"""Talk to a running `shoal serve` with the official `openai` client.

make serve                       # in one terminal (or: shoal serve [MODEL] --port 8000)
pip install openai               # the official client (make test installs it too)
python examples/openai_client.py [BASE_URL]   # default http://127.0.0.1:8000/v1
"""

import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key="EMPTY")  # pass the server's --api-key if it has one
model = client.models.list().data[0].id

completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
print(f"completion -> {completion.choices[0].text!r}")

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name three primary colors."}],
    max_tokens=48,
    temperature=0,
)
print(f"chat -> {chat.choices[0].message.content!r} ({chat.usage.total_tokens} tokens)")

print("streamed chat -> ", end="", flush=True)
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Write a haiku about the sea."}],
    max_tokens=48,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
    # shoal's extra sampling fields (vLLM's names) go in extra_body.
    extra_body={"repetition_penalty": 1.1},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n({chunk.usage.completion_tokens} tokens)")
