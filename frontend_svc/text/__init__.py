"""Text to tokens and back: the tokenizer, chat templates, prompt encoding, detokenizing, stop
strings."""
