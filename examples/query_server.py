"""Query a running server (examples/serve_clover.sh) with the openai client, then read how
many draft tokens vLLM accepted from its Prometheus /metrics.

    python examples/query_server.py --port 8000
"""

import argparse
import urllib.request

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, default=8000)
args = parser.parse_args()
base_url = f"http://127.0.0.1:{args.port}"

client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")  # vLLM ignores the key
model = client.models.list().data[0].id

completion = client.completions.create(model=model, prompt="def read_config(path):", max_tokens=64, temperature=0)
print("completion:", completion.choices[0].text)

chat = client.chat.completions.create(model=model, max_tokens=64, temperature=0,
                                      messages=[{"role": "user", "content": "Write a function that sorts a list."}])
print("chat:", chat.choices[0].message.content)

# Speculative decoding counters (prefix vllm:spec_decode_), summed over label sets.
metrics = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
    total = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith(f"vllm:spec_decode_{name}_total"))
    print(f"{name}: {total:.0f}")
