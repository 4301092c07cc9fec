# %% [markdown]
# # 01 · Tokenization: how text becomes the integers a model reads
#
# **Goal.** See exactly how the real model's tokenizer cuts text into pieces, compare it with the
# tokenizer behind GPT-4 (cl100k_base), and measure what text costs in tokens.
#
# **You will**
# - read a tokenization as coloured chips and spot spaces, byte fragments and special tokens;
# - measure words and characters per token on real texts, and test the "0.75 words per token" rule;
# - train a tiny byte-pair encoder yourself and watch a vocabulary grow from bytes.

# %% [markdown]
# ## Set-up
#
# We need only the model's tokenizer here, but `load_model()` is quick, and the exercises use both.
# `cl100k()` returns OpenAI's cl100k_base encoding from a file installed with the course: no download.

# %%
from pathlib import Path
import matplotlib.pyplot as plt
from IPython.display import HTML, display
import course_lib
from course_lib.views import plots, html_views
from course_lib.text.tokenization import (bpe_encode, bpe_vocab, cl100k, cl100k_tokens, cost, economy, encode,
                                          model_tokens, piece_lengths, round_trips, train_bpe, word_shapes)

model, tokenizer = course_lib.load_model()
TEXTS = {p.stem: p.read_text() for p in sorted(Path("../data/texts").glob("*.txt"))}
print("texts:", list(TEXTS))

# %% [markdown]
# ## 1. Two tokenizers, one sentence
#
# Each chip is one token: its text on top, its ID below. Spaces show as `␣` and newlines as `↵`, so
# you can see that a space usually travels *with the word after it*. Dark chips are special tokens.
# A chip with a dashed red border holds bytes that are only part of a character.

# %%
line = "What is the capital of France?"
display(HTML(html_views.compare(model_tokens(tokenizer, line), cl100k_tokens(line))))

# %% [markdown]
# The counts match here, but the IDs do not. A popular explainer prints seven IDs for this question;
# which tokenizer do they come from? We check them against both, position by position:

# %%
quoted = [1867, 374, 279, 6864, 315, 9822, 30]  # the explainer's IDs for "What is the capital of France?"
ours, gpt4 = encode(tokenizer, line), cl100k().encode(line)
print("explainer:", quoted, "\ncl100k:   ", gpt4, "\nSmolLM2:  ", ours)
print(f"matches: cl100k {sum(a == b for a, b in zip(quoted, gpt4))} of 7, SmolLM2 {sum(a == b for a, b in zip(quoted, ours))} of 7")
print(f"the first differs: cl100k reads {quoted[0]} as {cl100k().decode([quoted[0]])!r}, "
      f"and writes 'What' as {gpt4[0]} ({cl100k().decode([gpt4[0]])!r})")
for word in [" France", " capital"]:  # the explainer: France is 1 token, "capital" might be 2
    print(f"{word!r}: {len(encode(tokenizer, word))} token(s) in SmolLM2, {len(cl100k().encode(word))} in cl100k")

# %% [markdown]
# So the explainer's IDs are cl100k_base's, with the first one wrong (the printed count above says how
# many agree), and with a leading space " capital" is a single token in both tokenizers, as " France" is;
# this model would read those IDs as other words entirely. IDs only make sense with the
# vocabulary they came from.

# %%
multilingual = "Crème brûlée à Paris, 東京タワー 👨‍👩‍👧!"
display(HTML(html_views.compare(model_tokens(tokenizer, multilingual), cl100k_tokens(multilingual))))

# %% [markdown]
# ## 2. Try it
#
# Type in the box: both tokenizations update as you type. (In the rendered edition the box is
# replaced by the chips above.)

# %%
from course_lib.views.widgets import tokenizer_box
tokenizer_box(tokenizer)

# %% [markdown]
# ## 3. The classic surprises, on the real tokenizer
#
# **A long word becomes pieces.** Frequent words get a token of their own; rarer ones are built from parts.

# %%
for word in ["Unbelievable", "unbelievable", "tokenization", "France"]:
    pieces = model_tokens(tokenizer, word)
    print(f"{word!r:>16} -> {len(pieces)} tokens {[t.text for t in pieces]}")

# %% [markdown]
# **Numbers are split oddly.** Look at how each tokenizer cuts digits: one splits every digit, the
# other groups them. Either way the model never sees "a number", only pieces of one, which is one
# reason small models are bad at arithmetic.

# %%
for text in ["12345678", "2024-12-01", "1,000,000", "3.14159"]:
    ours, theirs = model_tokens(tokenizer, text), cl100k_tokens(text)
    print(f"{text!r:>12}  SmolLM2 {len(ours):>2}: {[t.text for t in ours]}")
    print(f"{'':>12}  cl100k  {len(theirs):>2}: {[t.text for t in theirs]}")

# %% [markdown]
# **Capitals and a leading space change the IDs.** To the model, `Paris`, `␣Paris`, `paris` and
# `PARIS` are unrelated token sequences; it has to learn from data that they mean the same city.

# %%
for text in ["Paris", " Paris", "paris", "PARIS"]:
    print(f"{text!r:>9} -> IDs {encode(tokenizer, text)}")

# %% [markdown]
# **One emoji costs several tokens.** A byte-level tokenizer can write any text, because any
# character is a few bytes and every byte has a token. Characters it has not learned as a whole are
# spelled out in bytes: the dashed chips below are fragments that are not text on their own.

# %%
for text in ["👍", "🇫🇷", "👨‍👩‍👧"]:
    toks = model_tokens(tokenizer, text)
    print(f"{text} = {len(text)} code point(s), {len(text.encode())} bytes, {len(toks)} tokens:", [t.text for t in toks])
display(HTML(html_views.token_chips(model_tokens(tokenizer, "👨‍👩‍👧"), "the family emoji, SmolLM2")))

# %% [markdown]
# **Special tokens are single IDs.** The chat markers are one token each. Notice what happens when a
# user *types* the marker as plain text: this tokenizer turns it into the real special token, while
# tiktoken (as called here) treats it as ordinary characters. Servers must guard against that.

# %%
for text in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
    print(f"{text:>15}: SmolLM2 {encode(tokenizer, text)}  cl100k {[t.id for t in cl100k_tokens(text)]}")
print("all special tokens of the model:", tokenizer.all_special_tokens)

# %% [markdown]
# ## 4. The token economy, measured
#
# Providers bill per token and context windows are counted in tokens, so what matters is how many
# tokens a text costs. We measure six texts kept in `data/texts/`: English prose, Python code, numbers
# and dates, French, Chinese, and a chat message full of emoji.

# %%
rows = [economy(tokenizer, name, text) for name, text in TEXTS.items()]
print(f"{'text':<15}{'words':>6}{'chars':>7}{'SmolLM2':>9}{'cl100k':>8}{'words/tok':>11}{'chars/tok':>10}")
for r in rows:
    print(f"{r.name:<15}{r.words:>6}{r.chars:>7}{r.model_tokens:>9}{r.cl100k_tokens:>8}"
          f"{r.words_per_token['model']:>11.2f}{r.chars_per_token['model']:>10.2f}")

# %%
ax = plots.plot_chars_per_token([r.name for r in rows], [r.chars_per_token["model"] for r in rows],
                                [r.chars_per_token["cl100k"] for r in rows])
plt.show()

# %% [markdown]
# **"A token is about 0.75 words in English."** Here is what our English text gives with each tokenizer:

# %%
english = next(r for r in rows if r.name == "english_prose")
for name in ("model", "cl100k"):
    wpt = english.words_per_token[name]
    print(f"{name:>7}: {wpt:.2f} words per token ({1 / wpt:.2f} tokens per word)")

# %% [markdown]
# The rule is a rough average for English; on plain narrative prose both tokenizers can do a bit
# better, while code, numbers, other languages and emoji cost far more tokens per word (see the table).
# Words are not even well defined for Chinese, which has no spaces: characters per token is the
# fairer measure there. A rule of thumb for English prose does not transfer.
#
# **"Tokens are syllable-sized pieces", "punctuation is its own token."** Both are often said. Count them
# with the tokenizer's own offsets: how many words one token covers whole (its leading space included),
# and how many punctuation marks sit in a token of their own:

# %%

for name in ("english_prose", "french", "python_code"):
    w = word_shapes(tokenizer, TEXTS[name])
    print(f"{name:<14} {w['whole_words'] / w['words']:6.1%} of {w['words']} words are one whole token | "
          f"{w['punctuation_alone']} of {w['punctuation']} punctuation marks have a token to themselves")

# %% [markdown]
# In this English prose nearly every word is one token: common English words are in the vocabulary
# whole, so a token is a word far more often than a syllable; only rarer words split. French, with less of
# its vocabulary learned, splits many more words. Punctuation in prose is mostly alone, while code merges
# marks into pairs and runs (`()`, `):`, `==`): the claim holds for prose, not for code. These are three
# short texts; the counts are this run's, on the files in `data/texts/`.
#
# **A cost calculator.** Change the price (in dollars per million tokens) and the text:

# %%
price_per_million = 3.00  # edit me
for r in rows:
    print(f"{r.name:<15} {r.model_tokens:>5} tokens -> ${cost(r.model_tokens, price_per_million):.6f}")

# %% [markdown]
# ## 5. The vocabularies
#
# The model's vocabulary is about half the size of cl100k_base. A bigger vocabulary means longer
# pieces on average (fewer tokens per text) but a bigger embedding table and output layer.

# %%
enc = cl100k()
print("SmolLM2 vocabulary:", len(tokenizer), "| cl100k_base:", enc.n_vocab)
lengths = piece_lengths(tokenizer)
ax = plots.plot_length_histogram(lengths)
plt.show()

# %% [markdown]
# ## 6. The round trip
#
# Decoding the tokens of a text must give back exactly that text: accents, CJK, emoji and odd spaces
# included. (The test suite checks this on many more strings.)

# %%
for text in ["café", "東京タワー", "👨‍👩‍👧 family", "  two spaces", "tab\there", multilingual]:
    print(f"{text!r:<40} round trip: {round_trips(tokenizer, text)}")

# %% [markdown]
# ## 7. From scratch: train a tiny byte-pair encoder
#
# Where does a vocabulary come from? Byte-pair encoding starts from the 256 possible bytes and
# repeatedly fuses the most frequent neighbouring pair into a new token. `train_bpe` does exactly
# that in about twenty lines (read it in `course_lib/text/tokenization.py`). We train it on the English text.

# %%
merges = train_bpe(TEXTS["english_prose"], num_merges=200)
vocab = bpe_vocab(merges)
print(f"learned {len(merges)} merges of the 200 asked for (training stops when no pair occurs twice); the first twenty:")
print([vocab[new_id].decode("utf-8", "replace") for _, new_id in merges[:20]])

# %% [markdown]
# The first merges are the commonest neighbouring pairs of this one short text: read the printed list (a
# letter next to a space, pieces of "the", endings). Now tokenize words with those merges: frequent words become one or two pieces, rare ones stay in bits.

# %%
for word in [" the train", " station", " conductor", " Unbelievable"]:
    print(f"{word!r:>16} -> {[p.decode('utf-8', 'replace') for p in bpe_encode(word, merges)]}")

# %% [markdown]
# Real tokenizers do the same with tens of thousands of merges learned on far more text, and they
# first split text with a regular expression so that merges stay inside words.

# %% [markdown]
# ---
# ## Summary
#
# - A tokenizer maps text to IDs from a fixed vocabulary; the same text gives different IDs in different models.
# - Spaces travel with the following word; capitals, spaces and digits all change the pieces.
# - Byte-level tokenizers can encode anything; characters they have not learned cost several byte tokens.
# - Tokens per word depend heavily on the kind of text: measured above, not assumed.
# - Byte-pair encoding builds a vocabulary by merging the most frequent neighbouring pieces, again and again.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `count_both(text)` returning a tuple: (tokens with the model's tokenizer, tokens with
# cl100k_base), without special tokens.

# %%
from course_lib.exercises import lesson01 as ex

def count_both(text):
    ...  # your code here
    raise NotImplementedError

ex.check_count_both(count_both, tokenizer)

# %% [markdown]
# **2.** Find a word of at least five letters that is **one** token when preceded by a space, but two
# or more tokens without it. Put it in `word`.

# %%
word = "..."  # your word here
ex.check_space_word(word, tokenizer)

# %% [markdown]
# **3.** Write `first_merge(text)`: the most frequent pair of adjacent bytes in `text.encode("utf-8")`,
# as a tuple of two ints. That is the first merge a BPE trainer would learn.

# %%
def first_merge(text):
    ...  # your code here
    raise NotImplementedError

ex.check_first_merge(first_merge)

# %% [markdown]
# **4.** Providers bill the prompt's tokens and the answer's tokens at different prices (lesson 08 measures
# one reason). Write `cost_of(prompt, answer, price_in, price_out)`: the price of one request, in dollars,
# with the model's tokenizer, prices given per million tokens.

# %%
def cost_of(prompt, answer, price_in, price_out):
    ...  # your code here
    raise NotImplementedError

ex.check_cost(cost_of, tokenizer)

# %% [markdown]
# **5. Predict, then measure.** How many tokens does the model's tokenizer make of this Spanish sentence? Use
# section 4's table (characters per token for each kind of text) and write your number in `prediction` before
# running the check.

# %%
print(repr(ex.SPANISH), f"({len(ex.SPANISH)} characters)")
prediction = None  # your prediction: tokens
ex.check_count_prediction(prediction, tokenizer)

# %% [markdown]
# **Next:** 02 · context assembly, where tokens are wrapped into the exact context the model reads.
