import json

model = tokenizer = None


def make_body(question):
    return {"messages": [{"role": "user", "content": question}], "stream": True, "max_tokens": 50}


def parse_stream(raw):
    text = ""
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[len("data: "):])["choices"][0]["delta"].get("content", "")
    return text


def ttft(start, arrival_times):
    return min(arrival_times) - start
