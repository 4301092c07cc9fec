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


def load_prediction(clients=4):
    """Between the measured one and eight clients, in proportion to the clients (measured here on a fresh server)."""
    from course_lib.exercises.lesson10 import mean_ttft
    from course_lib.serve.serving import free_port, start_server
    server = start_server(model, tokenizer, port=free_port())
    try:
        mean_ttft(server.url, 1)
        one, eight = mean_ttft(server.url, 1), mean_ttft(server.url, 8)
    finally:
        server.stop()
    return 1000 * (one + (eight - one) * (clients - 1) / 7)
