"""Serving (lessons 10 and 13): openai_api (OpenAI's dialect, read and refused), engine_thread (the background
thread that runs the loop for every request) and serving (HTTP: the FastAPI app, the server handle)."""
