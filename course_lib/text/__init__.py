"""Text in: tokenization (tokens, their costs, two tokenizers side by side) and context (the chat template, what fits
the window, the course's running prompts). The floor above runtime and loading; imports no other wing."""
